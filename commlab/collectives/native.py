"""The backend's own all-reduce (Gloo or NCCL), the reference every other algorithm is held to."""

from __future__ import annotations

import torch
import torch.distributed as dist

from commlab.collectives import streams
from commlab.collectives.reduce_ops import finish_
from commlab.collectives.handle import CollectiveHandle
from commlab.collectives.worker import worker_for

_OPS = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


def native_all_reduce(tensor: torch.Tensor, op: str = "sum", *, group=None, async_op: bool = False):
    """``dist.all_reduce``; avg is a sum then one division (Gloo has no ReduceOp.AVG).

    The async handle's future yields the tensor itself (not torch's one-element list), the same
    contract as the p2p algorithms. Its ``launched`` stamp is the issue (on CUDA an event on the
    current stream, which the backend's own stream waits on before the collective).
    """
    n = dist.get_world_size(group)
    if not async_op:
        dist.all_reduce(tensor, _OPS[op], group=group)
        finish_(tensor, op, n)
        return None
    launched = streams.stamp(torch.cuda.current_stream(tensor.device) if tensor.is_cuda else None)
    work = dist.all_reduce(tensor, _OPS[op], group=group, async_op=True)

    def done(fut: torch.futures.Future) -> torch.Tensor:
        fut.value()  # re-raise a failure
        finish_(tensor, op, n)
        return tensor

    what = f"native all-reduce of {tensor.numel()} x {tensor.dtype}"
    handle = CollectiveHandle(work.get_future().then(done), worker_for(group).timeout, what)
    handle.launched = launched
    return handle
