"""The three collectives sharded data parallelism issues: all-gather, reduce-scatter, all-reduce.

Only the backend's own collectives (``algorithm="native"``) for now: commlab's p2p ring and
halving-doubling reduce-scatter and all-gather are not plugged in here yet, and any other name
is refused with a ValueError at construction. Every call is asynchronous and returns torch's
work handle; Gloo's reduce-scatter and all-gather handles have no future (``Work::getFuture``
is not implemented), so completion is observed only by ``wait()``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

ALGORITHMS = ("native",)

# torch 2.13 renamed reduce_scatter_tensor and all_gather_into_tensor (the old names warn); take
# the new ones where present.
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def check_algorithm(algorithm: str) -> None:
    if algorithm not in ALGORITHMS:
        raise ValueError(
            f"algorithm={algorithm!r} is not available for sharded data parallelism; it runs the "
            f"backend's own collectives only: one of {list(ALGORITHMS)}"
        )


def all_gather(full: torch.Tensor, shard: torch.Tensor, group) -> dist.Work:
    """Every rank's ``shard`` into ``full`` (rank r's at ``r * shard.numel()``)."""
    return _all_gather(full, shard, group=group, async_op=True)


def reduce_scatter(shard: torch.Tensor, full: torch.Tensor, group) -> dist.Work:
    """The sum over ranks of ``full``'s rank-r piece into rank r's ``shard``."""
    return _reduce_scatter(shard, full, op=dist.ReduceOp.SUM, group=group, async_op=True)


def all_reduce(full: torch.Tensor, group) -> dist.Work:
    return dist.all_reduce(full, op=dist.ReduceOp.SUM, group=group, async_op=True)
