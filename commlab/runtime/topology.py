"""The tp x pp x dp topology: which rank holds which tensor block of which pipeline stage of which replica.

Ranks form the mesh ``arange(world).view(dp, pp, tp)``, torch's ``init_device_mesh`` order (and
picotron's): data parallelism outermost, tensor parallelism innermost. A tensor-parallel group is
thus ``tp`` consecutive ranks, which on a multi-GPU node keeps the collectives that sit on every
layer's critical path on the fastest links; a pipeline is the ``pp`` stages of one replica at one
tensor rank, and a data-parallel group the ``dp`` replicas of one stage's block. Every layout,
2-D ones included, uses this one order: a layout only places ranks, so changing it moves traffic
between links but never changes what is computed. (Before 3D layouts, pp x dp laid dp innermost;
the call forms ``Topology.build(pp, dp)`` and ``grid(pp, dp)`` are kept, in the new order.)

Hybrid sharding (``shard``, default dp: plain sharding) splits each data-parallel group into
``dp / shard`` shard groups of ``shard`` consecutive dp ranks (shard innermost, as torch's
``init_device_mesh((replicate, shard))`` lays them, so the all-gathers and reduce-scatters stay
on close ranks) and ``shard`` replicate groups, every ``shard``-th dp rank (:func:`hybrid_groups`).

The mesh is pure (:func:`mesh`, :func:`coordinates`, :func:`check_dims`, :func:`check_shard`) and
validated without processes; :meth:`Topology.build` creates the process groups. ``dist.new_group``
is collective over the whole world, so every rank creates every group, in the same order (tensor,
pipeline, data parallel, shard, replicate), and keeps those it belongs to. The object is passed
explicitly; commlab keeps no process group in a global.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass, field

import torch.distributed as dist


def check_dims(world_size: int | None = None, *, tp: int = 1, pp: int = 1, dp: int | None = None) -> tuple[int, int, int]:
    """``(tp, pp, dp)`` with dp defaulting to ``world_size // (tp * pp)``; ValueError for a size that
    is not a positive integer or a product that is not the world size. Pure: a launcher calls it
    before starting any process."""
    for name, value in (("tp", tp), ("pp", pp), ("dp", dp)):
        if value is None and name == "dp":
            continue
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if dp is None:
        if world_size is None:
            raise ValueError("dp is needed when the world size is not known")
        if world_size % (tp * pp):
            raise ValueError(f"tp x pp = {tp} x {pp} = {tp * pp} does not divide the world's {world_size} ranks")
        dp = world_size // (tp * pp)
    if world_size is not None and tp * pp * dp != world_size:
        raise ValueError(f"tp x pp x dp = {tp} x {pp} x {dp} = {tp * pp * dp}, but the world has {world_size} ranks")
    return tp, pp, dp


def check_shard(dp: int, shard: int | None) -> int:
    """The shard group's size, ``dp`` when None; ValueError unless it is a positive integer that
    divides ``dp`` (dp = replicate x shard)."""
    if shard is None:
        return dp
    if not isinstance(shard, int) or isinstance(shard, bool) or shard < 1:
        raise ValueError(f"shard must be a positive integer, got {shard!r}")
    if dp % shard:
        raise ValueError(f"shard = {shard} does not divide dp = {dp} (dp = replicate x shard)")
    return shard


def hybrid_groups(dp_ranks: list[int], shard: int) -> tuple[list[list[int]], list[list[int]]]:
    """``(shard_groups, replicate_groups)`` of one data-parallel group (its global ranks, replica 0
    first): ``dp_ranks`` viewed as (replicate, shard); shard groups are its rows (consecutive
    runs), replicate groups its columns (every ``shard``-th rank)."""
    shard = check_shard(len(dp_ranks), shard)
    rows = [dp_ranks[i : i + shard] for i in range(0, len(dp_ranks), shard)]
    return rows, [list(column) for column in zip(*rows)]


def mesh(tp: int, pp: int, dp: int) -> list[list[list[int]]]:
    """``mesh[replica][stage][tp_rank]`` = global rank, i.e. ``arange(dp * pp * tp).view(dp, pp, tp)``."""
    check_dims(tp=tp, pp=pp, dp=dp)
    return [[[(replica * pp + stage) * tp + t for t in range(tp)] for stage in range(pp)] for replica in range(dp)]


def coordinates(rank: int, tp: int, pp: int, dp: int) -> tuple[int, int, int]:
    """``(replica, stage, tp_rank)`` of a global rank: the inverse of :func:`mesh`."""
    check_dims(tp=tp, pp=pp, dp=dp)
    if not isinstance(rank, int) or not 0 <= rank < tp * pp * dp:
        raise ValueError(f"rank {rank!r} is outside a {tp} x {pp} x {dp} (tp x pp x dp) mesh")
    return rank // (pp * tp), rank // tp % pp, rank % tp


def grid(pp: int, dp: int) -> list[list[int]]:
    """``grid[stage][replica]`` = global rank of a pp x dp layout (tp = 1), in the mesh's order."""
    layout = mesh(1, pp, dp)
    return [[layout[replica][stage][0] for replica in range(dp)] for stage in range(pp)]


@dataclass(frozen=True)
class Topology:
    """This rank's place in a tp x pp x dp mesh, with its tensor, pipeline and data-parallel groups
    (and, where ``shard`` < dp, its shard and replicate groups; else ``shard_group`` is the
    data-parallel group and ``replicate_group`` None)."""

    pp: int
    dp: int
    rank: int
    tp: int = 1
    pp_group: dist.ProcessGroup | None = field(default=None, compare=False, repr=False)
    dp_group: dist.ProcessGroup | None = field(default=None, compare=False, repr=False)
    tp_group: dist.ProcessGroup | None = field(default=None, compare=False, repr=False)
    shard: int | None = None  # the shard group's size; None: dp (plain sharding, no replicas)
    shard_group: dist.ProcessGroup | None = field(default=None, compare=False, repr=False)
    replicate_group: dist.ProcessGroup | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        coordinates(self.rank, self.tp, self.pp, self.dp)
        object.__setattr__(self, "shard", check_shard(self.dp, self.shard))

    @property
    def replicate(self) -> int:
        """How many replicas of each shard there are (dp / shard)."""
        return self.dp // self.shard

    @property
    def shard_ranks(self) -> list[int]:
        """Global ranks of this rank's shard group (consecutive dp ranks), shard 0 first."""
        return next(g for g in hybrid_groups(self.dp_ranks, self.shard)[0] if self.rank in g)

    @property
    def replicate_ranks(self) -> list[int]:
        """Global ranks holding the same shard as this rank, replica 0 first."""
        return next(g for g in hybrid_groups(self.dp_ranks, self.shard)[1] if self.rank in g)

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def replica(self) -> int:
        """This rank's data-parallel replica (outermost index of the mesh)."""
        return coordinates(self.rank, self.tp, self.pp, self.dp)[0]

    @property
    def stage(self) -> int:
        """This rank's pipeline stage."""
        return coordinates(self.rank, self.tp, self.pp, self.dp)[1]

    @property
    def tp_rank(self) -> int:
        """This rank's block in its tensor-parallel group (innermost index of the mesh)."""
        return coordinates(self.rank, self.tp, self.pp, self.dp)[2]

    @property
    def tp_ranks(self) -> list[int]:
        """Global ranks of this stage's tensor-parallel group, block 0 first (consecutive)."""
        return mesh(self.tp, self.pp, self.dp)[self.replica][self.stage]

    @property
    def pp_ranks(self) -> list[int]:
        """Global ranks of this replica's pipeline at this tensor rank, stage 0 first."""
        return [row[self.tp_rank] for row in mesh(self.tp, self.pp, self.dp)[self.replica]]

    @property
    def dp_ranks(self) -> list[int]:
        """Global ranks holding this rank's stage and block, replica 0 first."""
        return [replica[self.stage][self.tp_rank] for replica in mesh(self.tp, self.pp, self.dp)]

    @classmethod
    def build(
        cls, pp: int = 1, dp: int | None = None, *, tp: int = 1, shard: int | None = None, timeout: float = 300.0
    ) -> Topology:
        """Create every group of the mesh (collective: all ranks call it) and return this rank's view.

        ``dp`` defaults to the world size over ``tp * pp``; ``shard`` to dp, where ``shard_group``
        is the data-parallel group and ``replicate_group`` None (no replicas); otherwise both are
        created (:func:`hybrid_groups`). Validation happens before the first collective, so a
        wrong shape raises ValueError on every rank instead of leaving some ranks waiting inside
        ``new_group``.
        """
        if not dist.is_initialized():
            raise RuntimeError("Topology.build needs an initialised process group (use commlab.launch)")
        tp, pp, dp = check_dims(dist.get_world_size(), tp=tp, pp=pp, dp=dp)
        shard = check_shard(dp, shard)
        rank = dist.get_rank()
        layout = mesh(tp, pp, dp)
        wait = datetime.timedelta(seconds=timeout)
        lists = {
            "tp": [layout[r][s] for r in range(dp) for s in range(pp)],
            "pp": [[layout[r][s][t] for s in range(pp)] for r in range(dp) for t in range(tp)],
            "dp": [[layout[r][s][t] for r in range(dp)] for s in range(pp) for t in range(tp)],
        }
        if shard != dp:
            splits = [hybrid_groups(ranks, shard) for ranks in lists["dp"]]
            lists["shard"] = [g for rows, _ in splits for g in rows]
            lists["replicate"] = [g for _, columns in splits for g in columns]
        mine = {}
        for axis, groups in lists.items():  # the same order on every rank: new_group is collective
            for ranks in groups:
                group = dist.new_group(ranks, timeout=wait)
                if rank in ranks:
                    mine[axis] = group
        return cls(pp, dp, rank, tp, mine["pp"], mine["dp"], mine["tp"], shard,
                   mine.get("shard", mine["dp"]), mine.get("replicate"))
