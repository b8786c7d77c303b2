"""What one sharded configuration is made of for the ZeRO lowering: its knobs and its costs.

The knobs are ShardedDataParallel's keywords (:class:`ShardedSetting`); the costs are the DDP
lowering's for the workload (compute, contention, stage 1's all-reduce) plus the sharded
collectives' tables at the shard group's size and, under hybrid sharding (HSDP), the all-reduce
across the replicas (:class:`ShardedCosts`). commlab/costmodel/lowering/zero.py lowers them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from commlab.costmodel.lowering.buckets import DEFAULT_POLICY
from commlab.costmodel.lowering.ddp import StepCosts, step_costs
from commlab.costmodel.terms.costs import DDPProfile, SystemCosts
from commlab.runs.traffic import REPLICATE_ALL_REDUCE
from commlab.runs.zero_stage import ZeroStage, parse_stage


@dataclass(frozen=True)
class ShardedSetting:
    """The knobs of one sharded configuration (ShardedDataParallel's keywords)."""

    stage: int = 3
    prefetch: int = 1
    reshard: bool = True
    bucket_cap_mb: float = 25.0  # ShardedDataParallel's default
    accumulate: int = 1
    policy: Any = DEFAULT_POLICY
    optimizer_bytes: float = 0.0  # optimizer state per parameter: 0 for plain SGD (the sweep's), 8 for Adam

    @property
    def zero(self) -> ZeroStage:
        return parse_stage(self.stage)  # ValueError for a stage outside 0-3

    def __post_init__(self) -> None:
        if self.zero.ddp:
            raise ValueError("a sharded setting has stage 1, 2 or 3 (stage 0, DDP, is a DDPSetting)")
        if self.prefetch < 0 or self.accumulate < 1 or not self.bucket_cap_mb > 0:
            raise ValueError(f"prefetch >= 0, accumulate >= 1 and bucket_cap_mb > 0 needed, got "
                             f"{self.prefetch}, {self.accumulate}, {self.bucket_cap_mb}")


@dataclass(frozen=True)
class ShardedCosts:
    """The DDP lowering's costs of the workload (compute, contention, the all-reduce stage 1 uses)
    plus the sharded collectives of the same algorithm and world size."""

    step: StepCosts
    reduce_scatter: Callable[[int], float]  # full bucket bytes -> seconds
    all_gather: Callable[[int], float]
    world_size: int
    activation_bytes: int = 0  # what the profile says the forward keeps for backward (0: unknown)
    fresh: Callable[[int], float] | None = None  # bytes allocated anew and written once -> seconds
    algorithm: str = "native"  # the backend's collectives need an input apart from their output
    rows: tuple[int, ...] | None = None  # each parameter's dim 0, module order (None: not calibrated)
    staged_gather: bool = False  # the all-gather copies through a flat buffer of its own (Gloo's)
    # Hybrid sharding: ``world_size`` is the shard group's; ``replicas`` groups hold the same shards,
    # ``replicate`` prices the all-reduce across them and ``all_reduce`` stage 1's within a group.
    replicas: int = 1
    replicate: Callable[[int], float] | None = None
    all_reduce: Callable[[int], float] | None = None

    def alloc(self, nbytes: float) -> float:
        return self.fresh(int(nbytes)) if self.fresh is not None and nbytes > 0 else 0.0


def sharded_costs(system: SystemCosts, profile: DDPProfile, algorithm: str, world_size: int,
                  activation_bytes: int = 0, fresh: Callable[[int], float] | None = None,
                  rows: Sequence[int] | None = None, backend: str | None = None,
                  shard: int | None = None) -> ShardedCosts:
    """ValueError if the system lacks an all-reduce, reduce-scatter or all-gather table for them.
    ``shard`` < ``world_size``: hybrid sharding over groups of ``shard`` ranks, priced by the
    tables at that size and the ("replicate_all_reduce", algorithm, replicas) table."""
    step = step_costs(system, profile, algorithm, world_size, activation_bytes)
    s = shard or world_size
    if world_size % s:
        raise ValueError(f"a shard group of {s} does not divide the {world_size} data-parallel ranks")
    hybrid = s != world_size
    return ShardedCosts(step, system.collective("reduce_scatter", algorithm, s),
                        system.collective("all_gather", algorithm, s), s, int(activation_bytes),
                        fresh, algorithm, None if rows is None else tuple(int(r) for r in rows),
                        staged_gather=algorithm == "native" and backend == "gloo",
                        replicas=world_size // s,
                        replicate=system.collective(REPLICATE, algorithm, world_size // s) if hybrid else None,
                        all_reduce=system.collective("all_reduce", algorithm, s) if hybrid else None)


REPLICATE = REPLICATE_ALL_REDUCE  # the table of hybrid sharding's all-reduce across the replicas
