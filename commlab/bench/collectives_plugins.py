"""The collectives `commlab bench collectives` can run: one plug-in object each, in one registry.

A :class:`Collective` is nccl-tests' handful of functions as data: how many elements a message
of a given size holds, the data each rank starts from and the result it must end with, the
bus-bandwidth factor, and the run of one algorithm (synchronous). The driver
(:mod:`commlab.bench.collectives_run`) owns warm-up, iterations, the size sweep and the check.
Adding a collective is one :func:`register` call with its functions at module level (ranks are
spawned, so the object travels to them by pickle):

    register(Collective("reduce", algorithms=..., busbw_factor=..., init=..., expected=..., run=...))

Buffers: every rank holds an ``input`` of ``count`` elements (its own data) and a work buffer
``buf`` of the same size; ``run(algorithm, input, buf, op, placement)`` must leave the result in
``result(buf, rank, world)``. Before each iteration the driver copies ``input`` into ``buf``
(untimed), so "in-place" runs on ``buf`` itself and "out-of-place" reads ``input`` and writes
``buf`` (nccl-tests' two placements). Sizes: ``size`` is the whole buffer in bytes and ``count``
its elements, as nccl-tests reports them for the collectives here.

Bus bandwidth (nccl-tests' doc/PERFORMANCE.md) is ``algbw * factor``, the factor being the bytes
through one rank per byte of buffer, derived in commlab/runs/traffic.py.

The data follow nccl-tests' idea of values exact in every dtype: rank r's element i is
(r + 1) * (i % 5 + 1), so sums stay small integers (exact even in bfloat16 up to 8 ranks).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
import torch.distributed as dist

from commlab import collectives
from commlab.collectives.reduce_ops import finish_
from commlab.collectives.scatter_gather import check_scatter_gather
from commlab.collectives.schedules import chunk_bounds
from commlab.runs.traffic import bus_factor

_OPS = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
# torch 2.13 renamed the flat-tensor collectives (the old names warn); older torch has the old ones.
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


@dataclass(frozen=True)
class Collective:
    """One collective of the benchmark (see the module docstring for each field's contract)."""

    name: str
    algorithms: Callable[[], list[str]]  # the algorithms ``run`` accepts, "native" first if any
    busbw_factor: Callable[[int], float]  # world size -> busbw / algbw
    init: Callable[..., torch.Tensor]  # (rank, world, count, dtype, device) -> this rank's input
    expected: Callable[..., torch.Tensor]  # (rank, world, count, dtype, op, device) -> the result
    run: Callable[[str, torch.Tensor, torch.Tensor, str, str], None]  # (algorithm, input, buf, op, placement)
    result: Callable[[torch.Tensor, int, int], torch.Tensor] | None = None  # (buf, rank, world) -> checked part [buf]
    blocks: bool = False  # count must split evenly over the ranks (one block each)
    reduces: bool = True  # takes --op; the table prints "none" otherwise
    root: int = -1  # nccl-tests' root column: -1 where there is none
    check_world: Callable[[str, int], None] | None = None  # (algorithm, world) -> ValueError if it cannot run

    def check(self, algorithm: str, world: int) -> None:
        """ValueError if ``algorithm`` cannot run on ``world`` ranks (checked before any launch)."""
        if self.check_world is not None:
            self.check_world(algorithm, world)

    def count(self, nbytes: int, element: int, world: int) -> int:
        """Elements of a message of about ``nbytes``: whole elements, whole blocks per rank."""
        count = max(1, nbytes // element)
        return max(world, count - count % world) if self.blocks else count

    def checked(self, buf: torch.Tensor, rank: int, world: int) -> torch.Tensor:
        return buf if self.result is None else self.result(buf, rank, world)


_REGISTRY: dict[str, Collective] = {}


def register(collective: Collective) -> Collective:
    if collective.name in _REGISTRY:
        raise ValueError(f"collective {collective.name!r} is registered twice")
    _REGISTRY[collective.name] = collective
    return collective


def collective_names() -> list[str]:
    return list(_REGISTRY)


def get_collective(name: str) -> Collective:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown collective {name!r}: choose from {', '.join(_REGISTRY)}") from None


# -- data shared by the built-ins --------------------------------------------------------------

def pattern(count: int, device) -> torch.Tensor:
    return torch.arange(count, device=device, dtype=torch.int64) % 5 + 1


def rank_data(rank: int, world: int, count: int, dtype: torch.dtype, device) -> torch.Tensor:
    """Rank ``rank``'s input of the reducing collectives: (rank + 1) * (i % 5 + 1)."""
    return (pattern(count, device) * (rank + 1)).to(dtype)


def reduced(world: int, count: int, dtype: torch.dtype, op: str, device) -> torch.Tensor:
    """The closed form of every rank's :func:`rank_data` reduced with ``op``."""
    p = pattern(count, device)
    total = p * (world * (world + 1) // 2)
    if op == "avg" and dtype.is_floating_point:  # (world + 1) / 2 * pattern, a multiple of 1/2: exact
        return (total.double() / world).to(dtype)
    out = {"sum": total, "max": p * world, "min": p}.get(op)
    return (torch.div(total, world, rounding_mode="floor") if out is None else out).to(dtype)


def _block(t: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    lo, hi = chunk_bounds(t.numel(), world)[rank]
    return t[lo:hi]


# -- all-reduce: every registered algorithm of commlab.collectives -----------------------------

def _all_reduce_expected(rank, world, count, dtype, op, device):
    return reduced(world, count, dtype, op, device)


def _all_reduce_run(algorithm, source, buf, op, placement):
    # commlab's all-reduce (like dist.all_reduce) works in place: out of place is the copy plus it.
    if placement == "out-of-place":
        buf.copy_(source)
    collectives.all_reduce(buf, op, algorithm=algorithm)


register(Collective("all_reduce", collectives.algorithm_names, partial(bus_factor, "all_reduce"), rank_data,
                    _all_reduce_expected, _all_reduce_run))


# -- reduce-scatter: the backend's, and commlab's ring and halving-doubling -------------------

def _reduce_scatter_algorithms() -> list[str]:
    return ["native", *collectives.scatter_gather_names()]


def _scatter_gather_world(algorithm: str, world: int) -> None:
    if algorithm != "native":
        check_scatter_gather(algorithm, world)


def _reduce_scatter_expected(rank, world, count, dtype, op, device):
    return _block(reduced(world, count, dtype, op, device), rank, world)


def _reduce_scatter_run(algorithm, source, buf, op, placement):
    rank, world = dist.get_rank(), dist.get_world_size()
    if algorithm == "native":  # out of place reads the input; in place reads buf, writes its block
        out = _block(buf, rank, world)
        _reduce_scatter(out, source if placement == "out-of-place" else buf, op=_OPS[op])
        finish_(out, op, world)
        return
    if placement == "out-of-place":
        buf.copy_(source)
    collectives.reduce_scatter(buf, op, algorithm=algorithm)


register(Collective("reduce_scatter", _reduce_scatter_algorithms, partial(bus_factor, "reduce_scatter"), rank_data,
                    _reduce_scatter_expected, _reduce_scatter_run, result=_block, blocks=True,
                    check_world=_scatter_gather_world))


# -- all-gather: the backend's, and commlab's ring and halving-doubling -----------------------

def _all_gather_init(rank, world, count, dtype, device):
    """Zeros but for this rank's own block (its data): a gather that skipped a peer shows."""
    out = torch.zeros(count, dtype=dtype, device=device)
    _block(out, rank, world).copy_(_block(rank_data(rank, world, count, dtype, device), rank, world))
    return out


def _all_gather_expected(rank, world, count, dtype, op, device):
    return torch.cat([_block(rank_data(r, world, count, dtype, device), r, world) for r in range(world)])


def _all_gather_run(algorithm, source, buf, op, placement):
    rank, world = dist.get_rank(), dist.get_world_size()
    own = _block(source if placement == "out-of-place" else buf, rank, world)
    if algorithm == "native":
        _all_gather(buf, own)
        return
    if placement == "out-of-place":
        _block(buf, rank, world).copy_(own)
    collectives.all_gather(buf, algorithm=algorithm)


register(Collective("all_gather", _reduce_scatter_algorithms, partial(bus_factor, "all_gather"), _all_gather_init,
                    _all_gather_expected, _all_gather_run, blocks=True, reduces=False,
                    check_world=_scatter_gather_world))


# -- broadcast from rank 0: the backend's, and commlab's pipelined tree -----------------------

def _broadcast_algorithms() -> list[str]:
    return ["native", "tree"]


def _broadcast_init(rank, world, count, dtype, device):
    """The root's data on the root, zeros elsewhere."""
    data = rank_data(0, world, count, dtype, device)
    return data if rank == 0 else torch.zeros_like(data)


def _broadcast_expected(rank, world, count, dtype, op, device):
    return rank_data(0, world, count, dtype, device)


def _broadcast_run(algorithm, source, buf, op, placement):
    # Neither torch nor commlab has an out-of-place broadcast: out of place is the copy plus it.
    if placement == "out-of-place":
        buf.copy_(source)
    if algorithm == "native":
        dist.broadcast(buf, src=0)
    else:
        collectives.broadcast(buf, src=0)


register(Collective("broadcast", _broadcast_algorithms, partial(bus_factor, "broadcast"), _broadcast_init,
                    _broadcast_expected, _broadcast_run, reduces=False, root=0))
