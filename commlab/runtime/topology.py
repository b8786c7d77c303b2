"""The pp x dp topology: which rank holds which pipeline stage of which data-parallel replica.

Ranks form the grid ``arange(world).view(pp, dp)`` (picotron's layout): row i holds the ``dp``
replicas of pipeline stage i, column j is replica j's whole pipeline. So the ranks of a
data-parallel group are consecutive, which on a multi-GPU node keeps gradient all-reduce (the
heavier traffic) on the fastest links, while pipeline neighbours exchange only activations.

The grid is pure (:func:`grid`) and validated without processes; :meth:`Topology.build` creates
the process groups. ``dist.new_group`` is collective over the whole world, so every rank creates
every group, in the same order, and keeps the two it belongs to. The object is passed explicitly;
commlab keeps no process group in a global.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass, field

import torch.distributed as dist


def grid(pp: int, dp: int) -> list[list[int]]:
    """``grid[stage][replica]`` = global rank, i.e. ``arange(pp * dp).view(pp, dp)`` as lists."""
    _check_dims(pp, dp)
    return [[stage * dp + replica for replica in range(dp)] for stage in range(pp)]


def _check_dims(pp: int, dp: int, world_size: int | None = None) -> None:
    for name, value in (("pp", pp), ("dp", dp)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if world_size is not None and pp * dp != world_size:
        raise ValueError(f"pp x dp = {pp} x {dp} = {pp * dp}, but the world has {world_size} ranks")


@dataclass(frozen=True)
class Topology:
    """This rank's place in a pp x dp grid, with its pipeline and data-parallel groups."""

    pp: int
    dp: int
    rank: int
    pp_group: dist.ProcessGroup | None = field(default=None, compare=False, repr=False)
    dp_group: dist.ProcessGroup | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        _check_dims(self.pp, self.dp)
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is outside a {self.pp} x {self.dp} grid")

    @property
    def world_size(self) -> int:
        return self.pp * self.dp

    @property
    def stage(self) -> int:
        """This rank's pipeline stage (its row in the grid)."""
        return self.rank // self.dp

    @property
    def replica(self) -> int:
        """This rank's data-parallel replica (its column in the grid)."""
        return self.rank % self.dp

    @property
    def pp_ranks(self) -> list[int]:
        """Global ranks of this replica's pipeline, stage 0 first."""
        return [row[self.replica] for row in grid(self.pp, self.dp)]

    @property
    def dp_ranks(self) -> list[int]:
        """Global ranks holding this rank's stage, replica 0 first."""
        return grid(self.pp, self.dp)[self.stage]

    @classmethod
    def build(cls, pp: int, dp: int, *, timeout: float = 300.0) -> Topology:
        """Create every group of the grid (collective: all ranks call it) and return this rank's view.

        Validation happens before the first collective, so a wrong shape raises ValueError on every
        rank instead of leaving some ranks waiting inside ``new_group``.
        """
        if not dist.is_initialized():
            raise RuntimeError("Topology.build needs an initialised process group (use commlab.launch)")
        _check_dims(pp, dp, dist.get_world_size())
        rank = dist.get_rank()
        layout = grid(pp, dp)
        wait = datetime.timedelta(seconds=timeout)
        pp_group = dp_group = None
        for replica in range(dp):  # pipelines (columns) first, then data-parallel groups (rows)
            group = dist.new_group([row[replica] for row in layout], timeout=wait)
            if rank in [row[replica] for row in layout]:
                pp_group = group
        for stage in range(pp):
            group = dist.new_group(layout[stage], timeout=wait)
            if rank in layout[stage]:
                dp_group = group
        return cls(pp, dp, rank, pp_group, dp_group)
