"""The p2p algorithms that provide a reduce-scatter and an all-gather, by name, and their limits.

Both work in place on a flat buffer with rank r's block at ``chunk_bounds(numel, world)[r]``:
the reduce-scatter leaves the reduced block r there, the all-gather reads it there and fills the
rest. The ring (commlab/collectives/ring.py) takes any world size; halving-doubling
(commlab/collectives/halving_doubling.py) power-of-two sizes only. Sharded data parallelism
(commlab/sharded/comm.py) and ``commlab bench collectives`` take their names from here.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from commlab.collectives.halving_doubling import all_gather_doubling, reduce_scatter_halving
from commlab.collectives.p2p import Comm
from commlab.collectives.ring import all_gather_ring, reduce_scatter_ring
from commlab.collectives.schedules import check_power_of_two

ReduceScatter = Callable[[torch.Tensor, str, Comm], None]  # (flat, op, comm)
AllGather = Callable[[torch.Tensor, Comm], None]  # (flat, comm)

# name -> (reduce-scatter body, all-gather body, world-size check)
_PAIRS: dict[str, tuple[ReduceScatter, AllGather, Callable[[int], None]]] = {
    "ring": (reduce_scatter_ring, all_gather_ring, lambda world: None),
    "halving_doubling": (reduce_scatter_halving, all_gather_doubling, check_power_of_two),
}


def scatter_gather_names() -> list[str]:
    return list(_PAIRS)


def check_scatter_gather(algorithm: str, world: int | None = None) -> None:
    """ValueError unless ``algorithm`` has a reduce-scatter and an all-gather that run on ``world``
    ranks (None: any size it takes)."""
    if algorithm not in _PAIRS:
        raise ValueError(f"no p2p reduce-scatter and all-gather named {algorithm!r}: choose from "
                         f"{', '.join(_PAIRS)}")
    if world is not None:
        _PAIRS[algorithm][2](world)


def reduce_scatter_body(algorithm: str) -> ReduceScatter:
    check_scatter_gather(algorithm)
    return _PAIRS[algorithm][0]


def all_gather_body(algorithm: str) -> AllGather:
    check_scatter_gather(algorithm)
    return _PAIRS[algorithm][1]
