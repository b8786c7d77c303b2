"""All-reduce algorithms written on torch.distributed point-to-point ops, and their registry.

>>> all_reduce(t, "sum", algorithm="ring")                      # in place, like dist.all_reduce
>>> h = all_reduce(t, "avg", algorithm="tree", async_op=True)   # runs on the group's worker
>>> h.get_future().wait() is t                                  # the future yields the tensor

Algorithms: ``ring``, ``tree``, ``halving_doubling`` (p2p, this package) and ``native`` (the
backend's ``dist.all_reduce``). The building blocks are public too: ``reduce_scatter`` and
``all_gather`` (ring, or halving-doubling on power-of-two groups: ``scatter_gather_names()``),
tree ``reduce`` and ``broadcast``. Ranks given to them are *group* ranks.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from commlab.collectives.halving_doubling import all_reduce_halving_doubling
from commlab.collectives.native import native_all_reduce
from commlab.collectives.p2p import Comm
from commlab.collectives.reduce_ops import DTYPES, OPS, check_op, check_tensor
from commlab.collectives.registry import algorithm_names, get_algorithm, register
from commlab.collectives.ring import all_reduce_ring
from commlab.collectives.scatter_gather import (
    all_gather_body,
    check_scatter_gather,
    reduce_scatter_body,
    scatter_gather_names,
)
from commlab.collectives.schedules import chunk_bounds
from commlab.collectives.tree import all_reduce_tree, broadcast_tree, reduce_tree
from commlab.collectives.handle import CollectiveHandle, wait_future
from commlab.collectives.worker import group_busy, group_timeout, release_groups, run_async, run_collective, run_ordered


def _p2p_algorithm(name: str, body: Callable[[torch.Tensor, str, Comm], None]) -> Callable:
    """Wrap ``body(flat, op, comm)`` with the shared checks and the worker (sync or async)."""

    def algorithm(tensor: torch.Tensor, op: str = "sum", *, group=None, async_op: bool = False):
        check_op(op)
        check_tensor(tensor, group)
        what = f"{name} all-reduce of {tensor.numel()} x {tensor.dtype}"
        return run_collective(lambda flat, tag: body(flat, op, Comm.of(group, tag)), tensor, group, async_op, what)

    return algorithm


register("ring")(_p2p_algorithm("ring", all_reduce_ring))
register("tree")(_p2p_algorithm("tree", all_reduce_tree))
register("halving_doubling")(_p2p_algorithm("halving_doubling", all_reduce_halving_doubling))


def _native(tensor: torch.Tensor, op: str = "sum", *, group=None, async_op: bool = False):
    check_op(op)
    check_tensor(tensor, group, p2p=False)
    # Issued on the group's one path, so it never lands inside a p2p batch of another thread.
    return run_ordered(group, lambda: native_all_reduce(tensor, op, group=group, async_op=async_op))


register("native")(_native)


def all_reduce(
    tensor: torch.Tensor, op: str = "sum", *, algorithm: str = "ring", group=None, async_op: bool = False
) -> CollectiveHandle | None:
    """Reduce ``tensor`` in place across the group, like ``dist.all_reduce``.

    With ``async_op=True`` returns a handle with ``wait()`` and ``get_future()``, whose value is
    ``tensor`` once reduced; otherwise returns None when done.
    """
    return get_algorithm(algorithm)(tensor, op, group=group, async_op=async_op)


def _check_peer(name: str, value: int, group) -> None:
    import torch.distributed as dist

    size = dist.get_world_size(group)
    if not isinstance(value, int) or not 0 <= value < size:
        raise ValueError(f"{name} must be a group rank in [0, {size}), got {value!r}")


def reduce_scatter(tensor: torch.Tensor, op: str = "sum", *, algorithm: str = "ring", group=None,
                   async_op: bool = False):
    """Reduce-scatter in place: this rank's block (``chunk_bounds(numel, size)[rank]`` of the
    flattened tensor) ends fully reduced; returns that block as a flat view (with ``async_op``, a
    handle whose future yields ``tensor``; the block is valid after ``wait()``). Other blocks end
    holding partial results. ``tensor`` must be contiguous (the result is a view of it).
    ``algorithm``: "ring" (any world size) or "halving_doubling" (power-of-two sizes)."""
    check_op(op)
    check_tensor(tensor, group)
    if not tensor.is_contiguous():
        raise ValueError("reduce_scatter returns a view of its input: pass a contiguous tensor")
    comm = Comm.of(group)
    check_scatter_gather(algorithm, comm.size)
    body = reduce_scatter_body(algorithm)
    handle = run_collective(lambda flat, tag: body(flat, op, Comm.of(group, tag)), tensor, group, async_op,
                            f"{algorithm} reduce-scatter of {tensor.numel()} x {tensor.dtype}")
    if async_op:
        return handle
    lo, hi = chunk_bounds(tensor.numel(), comm.size)[comm.rank]
    return tensor.view(-1)[lo:hi]


def all_gather(tensor: torch.Tensor, *, algorithm: str = "ring", group=None, async_op: bool = False):
    """All-gather in place: rank r contributes block r (of ``chunk_bounds``) of the flattened
    tensor, and every rank ends with every block. Returns None, or with ``async_op`` a handle.
    ``algorithm``: "ring" (any world size) or "halving_doubling" (power-of-two sizes)."""
    check_tensor(tensor, group)
    check_scatter_gather(algorithm, Comm.of(group).size)
    body = all_gather_body(algorithm)
    return run_collective(lambda flat, tag: body(flat, Comm.of(group, tag)), tensor, group, async_op,
                          f"{algorithm} all-gather of {tensor.numel()} x {tensor.dtype}")


def reduce(tensor: torch.Tensor, dst: int = 0, op: str = "sum", *, group=None) -> None:
    """Pipelined binary-tree reduce onto group rank ``dst``; other ranks' tensors end undefined."""
    check_op(op)
    check_tensor(tensor, group)
    _check_peer("dst", dst, group)
    run_collective(lambda flat, tag: reduce_tree(flat, op, Comm.of(group, tag), dst), tensor, group, False)


def broadcast(tensor: torch.Tensor, src: int = 0, *, group=None) -> None:
    """Pipelined binary-tree broadcast of group rank ``src``'s tensor to the whole group."""
    check_tensor(tensor, group)
    _check_peer("src", src, group)
    run_collective(lambda flat, tag: broadcast_tree(flat, Comm.of(group, tag), src), tensor, group, False)


__all__ = [
    "DTYPES",
    "OPS",
    "CollectiveHandle",
    "algorithm_names",
    "all_gather",
    "all_reduce",
    "broadcast",
    "chunk_bounds",
    "get_algorithm",
    "group_busy",
    "group_timeout",
    "reduce",
    "reduce_scatter",
    "release_groups",
    "run_async",
    "run_ordered",
    "scatter_gather_names",
    "wait_future",
]
