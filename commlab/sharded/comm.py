"""The three collectives sharded data parallelism issues: all-gather, reduce-scatter, all-reduce.

``algorithm`` picks who runs them (``"auto"``, the default, picks one per backend:
:func:`resolve_algorithm`): ``"native"``, the backend's own collectives, or a p2p
algorithm of :mod:`commlab.collectives` that provides both a reduce-scatter and an all-gather
(commlab/collectives/scatter_gather.py: the ring, any world size, and halving-doubling,
power-of-two world sizes; the tree provides all-reduce only). Any other name, or halving-doubling
on another world size, is refused with a ValueError at construction, before any collective.
Every call is asynchronous and returns a handle with ``wait()``: torch's work handle for the backend's (Gloo's reduce-scatter and all-gather give no
future: ``Work::getFuture`` is not implemented, so completion is observed by ``wait()`` only),
a :class:`commlab.collectives.CollectiveHandle` for a p2p algorithm, which runs on the group's
worker thread (commlab/collectives/worker.py) in the order issued, as DDP's buckets do.

The buffers are padded to a multiple of the world size (commlab/sharded/layout.py), so rank r's
shard is the r-th of ``chunk_bounds(padded, world)``'s equal blocks, the block the ring
algorithms reduce into and gather from: they work in place on the flat buffer.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from commlab import collectives
from commlab.collectives.p2p import Comm
from commlab.collectives.scatter_gather import (
    all_gather_body,
    check_scatter_gather,
    reduce_scatter_body,
    scatter_gather_names,
)
from commlab.collectives.worker import run_collective

ALGORITHMS = ("native", *scatter_gather_names())  # the algorithms that run; "auto" picks one of them
AUTO = "auto"
CHOICES = (AUTO, *ALGORITHMS)

# torch 2.13 renamed reduce_scatter_tensor and all_gather_into_tensor (the old names warn); take
# the new ones where present.
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def check_algorithm(algorithm: str, world: int | None = None) -> None:
    """ValueError unless ``algorithm`` provides both collectives on ``world`` ranks (None: the name
    only, before the process group is known)."""
    if algorithm == AUTO:
        return
    if algorithm not in ALGORITHMS:
        known = f" ({algorithm!r} is an all-reduce only)" if algorithm in collectives.algorithm_names() else ""
        raise ValueError(
            f"algorithm={algorithm!r} is not available for sharded data parallelism{known}: it needs a "
            f"reduce-scatter and an all-gather, which these provide: {', '.join(ALGORITHMS)} (or {AUTO!r})"
        )
    if algorithm != "native" and world is not None:
        check_scatter_gather(algorithm, world)


def resolve_algorithm(algorithm: str, backend: str, device_type: str = "cpu") -> str:
    """The algorithm ``algorithm`` names on ``backend`` for tensors on ``device_type``: itself, or
    for "auto" the ring on Gloo with CPU tensors and the backend's own collectives elsewhere (Gloo
    has no CUDA send/recv, so a p2p algorithm with CUDA tensors on Gloo is a ValueError).

    Why not Gloo's own: torch 2.13's ProcessGroupGloo has no reduce-scatter algorithm for a flat
    tensor: ``reduce_scatter_tensor_coalesced`` clones the whole input, all-reduces the clone and
    copies the rank's chunk out (torch/csrc/distributed/c10d/ProcessGroupGloo.cpp), twice the bytes
    a reduce-scatter moves plus two copies, and the list form was no faster than an all-reduce.
    Measured (one 25 MiB bucket, world size 2, the calls interleaved, 3 launches of 15, median of
    the slowest rank, wall ms, 2026-11-26, load 2.4 on 2 cores): reduce-scatter flat 33-37, list
    27-31, ring 20-21, halving-doubling 18-21; all-reduce 23-25; all-gather native 22-25, ring
    13-15, halving-doubling 14-15. NCCL's own reduce-scatter and all-gather are real ones."""
    check_algorithm(algorithm)
    gloo = str(backend).lower() == "gloo"
    if algorithm == AUTO:
        return "ring" if gloo and device_type == "cpu" else "native"
    if gloo and device_type != "cpu" and algorithm != "native":
        raise ValueError(f"algorithm={algorithm!r} runs on send/recv, which Gloo has for CPU tensors only: "
                         f"use 'native' (or 'auto') with {device_type} tensors on Gloo")
    return algorithm


def algorithms_for(world: int) -> list[str]:
    """The algorithms that run sharded data parallelism on ``world`` ranks."""
    out = []
    for name in ALGORITHMS:
        try:
            check_algorithm(name, world)
        except ValueError:
            continue
        out.append(name)
    return out


def _block(full: torch.Tensor, group) -> torch.Tensor:
    size = full.numel() // dist.get_world_size(group)
    rank = dist.get_rank(group)
    return full[rank * size : (rank + 1) * size]


def all_gather(full: torch.Tensor, shard: torch.Tensor, group, algorithm: str = "native"):
    """Every rank's ``shard`` into ``full`` (rank r's at ``r * shard.numel()``). A p2p algorithm
    gathers in place: ``shard`` may be that block of ``full`` itself (stages 1-2)."""
    if algorithm == "native":
        return _all_gather(full, shard, group=group, async_op=True)
    own = _block(full, group)
    if own.data_ptr() != shard.data_ptr():
        own.copy_(shard)
    body = all_gather_body(algorithm)
    return run_collective(lambda flat, tag: body(flat, Comm.of(group, tag)), full, group, True,
                          f"{algorithm} all-gather of {full.numel()} x {full.dtype}")


def reduce_scatter(shard: torch.Tensor, full: torch.Tensor, group, algorithm: str = "native"):
    """The sum over ranks of ``full``'s rank-r block into rank r's ``shard``. A p2p algorithm
    reduces in place (``full`` ends holding partial sums elsewhere) and copies the block out."""
    if algorithm == "native":
        if dist.get_backend(group) == "gloo":
            # Gloo's list reduce-scatter is its own algorithm; its flat-tensor one cost 1.5x the CPU
            # time here (33 against 22 ms for 32 MiB at world size 2, under load; 2026-11-25).
            chunks = list(full.chunk(dist.get_world_size(group)))
            return dist.reduce_scatter(shard, chunks, op=dist.ReduceOp.SUM, group=group, async_op=True)
        return _reduce_scatter(shard, full, op=dist.ReduceOp.SUM, group=group, async_op=True)
    body, own = reduce_scatter_body(algorithm), _block(full, group)

    def reduce(flat: torch.Tensor, tag: int) -> None:
        body(flat, "sum", Comm.of(group, tag))
        shard.copy_(own)

    return run_collective(reduce, full, group, True, f"{algorithm} reduce-scatter of {full.numel()} x {full.dtype}")


def all_reduce(full: torch.Tensor, group, algorithm: str = "native"):
    if algorithm == "native":
        return dist.all_reduce(full, op=dist.ReduceOp.SUM, group=group, async_op=True)
    return collectives.all_reduce(full, "sum", algorithm=algorithm, group=group, async_op=True)
