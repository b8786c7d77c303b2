"""The backend's own all-reduce (Gloo or NCCL), the reference every other algorithm is held to."""

from __future__ import annotations

import torch
import torch.distributed as dist

from commlab.collectives.registry import register

_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


@register("native")
def native_all_reduce(tensor: torch.Tensor, op: str = "sum", *, group=None, async_op: bool = False):
    if op == "avg":
        # Gloo has no ReduceOp.AVG: sum, then divide once the sum has arrived.
        work = dist.all_reduce(tensor, dist.ReduceOp.SUM, group=group, async_op=True)
        n = dist.get_world_size(group)
        fut = work.get_future().then(lambda f: f.value()[0].div_(n) if tensor.is_floating_point() else f.value()[0].floor_divide_(n))
        return _FutureWork(fut) if async_op else fut.wait()
    return dist.all_reduce(tensor, _OPS[op], group=group, async_op=async_op)


class _FutureWork:
    """A Work-like handle over a torch Future: wait() and get_future()."""

    def __init__(self, fut: torch.futures.Future):
        self._fut = fut

    def wait(self) -> bool:
        self._fut.wait()
        return True

    def get_future(self) -> torch.futures.Future:
        return self._fut
