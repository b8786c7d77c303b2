"""Local reductions (sum, avg, max, min) and the input checks every algorithm shares.

Precision: each received contribution is combined with one torch op in the tensor's own dtype,
so a float16/bfloat16 sum over p ranks is rounded p-1 times (torch computes each elementwise add
in float32 on CPU and rounds once), which is what NCCL and Gloo do on the wire dtype. Up-casting
the partial sums would double the bytes every step sends; for training gradients the wire dtype is
the usual choice. ``avg`` is a sum followed by one division at the owner of the result; integer
tensors divide with floor rounding (the exact sum, then ``//`` p), the same rule as ``native``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

OPS = ("sum", "avg", "max", "min")
DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.int64)


def check_op(op: str) -> None:
    if op not in OPS:
        raise ValueError(f"unknown reduce op {op!r}: choose from {', '.join(OPS)}")


def check_tensor(tensor: torch.Tensor, group=None, *, p2p: bool = True) -> None:
    """Raise ValueError for a tensor no algorithm here reduces correctly, before any message.

    ``p2p=False`` for the backend's own collective: Gloo reduces CUDA tensors itself (torch's
    ProcessGroupGloo has CUDA all-reduce algorithms) but has no CUDA send/recv for the p2p ones."""
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"expected a torch.Tensor, got {type(tensor).__name__}")
    if tensor.layout != torch.strided:
        raise ValueError(f"only dense (strided) tensors are supported, got layout {tensor.layout}")
    if tensor.dtype not in DTYPES:
        names = ", ".join(str(d).removeprefix("torch.") for d in DTYPES)
        raise ValueError(f"dtype {tensor.dtype} is not supported: choose from {names}")
    if not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialised: run inside commlab.launch(...)")
    if dist.get_rank(group) < 0:
        raise ValueError("this rank is not a member of the given process group")
    backend = str(dist.get_backend(group)).lower()
    if backend == "nccl" and not tensor.is_cuda:
        raise ValueError("backend 'nccl' reduces CUDA tensors: move the tensor to this rank's GPU")
    if p2p and backend == "gloo" and tensor.device.type != "cpu":
        raise ValueError(f"the p2p algorithms on backend 'gloo' need CPU tensors, got {tensor.device}")


def combine_(acc: torch.Tensor, incoming: torch.Tensor, op: str) -> None:
    """acc <- acc (op) incoming, in place; avg accumulates a sum (divided once at the end)."""
    if op in ("sum", "avg"):
        acc.add_(incoming)
    elif op == "max":
        torch.maximum(acc, incoming, out=acc)
    else:
        torch.minimum(acc, incoming, out=acc)


def finish_(result: torch.Tensor, op: str, world: int) -> None:
    """Turn a reduced sum into an average where ``op`` asks for one (no-op otherwise)."""
    if op != "avg" or world == 1:
        return
    if result.is_floating_point():
        result.div_(world)
    else:
        result.floor_divide_(world)
