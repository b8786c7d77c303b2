"""Tuning the sharding: the fastest stage x bucket x prefetch x reshard x shard group whose peak fits in memory.

    sharded_answer(entry, stages=(0, 1, 2, 3), memory_bytes=16 * 2**30)   # commlab tune --stage auto

Each candidate is simulated (stage 0 with the DDP lowering, commlab/costmodel/lowering/ddp.py, overlap
on; stages 1-3 with commlab/costmodel/lowering/zero.py) and its peak bytes per rank predicted; the
answer is the fastest candidate whose predicted peak fits, over every algorithm that has the
collectives a stage needs, and every shard group size the calibration has tables for (hybrid
sharding: shards within a group, replicas across; commlab/costmodel/lowering/zero.py). Near-ties (1e-9 relative) go to the smaller peak. When nothing fits,
a ValueError names the smallest peak found, so the user knows how much memory would do.

An UNSTEADY calibration (commlab/costmodel/terms/uncertainty.py) bends the predicted times, not the
predicted bytes, so without ``force`` the answer is then chosen without times
(:func:`default_pick`): the lowest stage that fits, at the defaults' settings, as DDP's answer is
then its default.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from commlab.costmodel.lowering.ddp import DDPSetting, breakdown, simulate_step
from commlab.costmodel.lowering.zero import ShardedSetting, sharded_breakdown, simulate_sharded
from commlab.runs.zero_stage import STAGES, parse_stage

GRID_MB = tuple(round(0.5 * 2 ** (i / 2), 3) for i in range(0, 17))  # 0.5 .. 128 MB, x1.41 steps
PREFETCHES = (0, 1, 2)


@dataclass(frozen=True)
class ShardedCandidate:
    stage: int
    algorithm: str
    bucket_cap_mb: float
    prefetch: int
    reshard: bool
    step_s: float
    peak_bytes: int
    shard_group: int = 0  # hybrid sharding: ranks per shard group (0: every data-parallel rank)

    def kwargs(self) -> dict[str, Any]:
        """ShardedDataParallel's keywords (stage 0: commlab DistributedDataParallel's)."""
        zero = parse_stage(self.stage)
        if zero.ddp:
            return {"bucket_cap_mb": self.bucket_cap_mb, "algorithm": self.algorithm}
        out = {"stage": self.stage, "bucket_cap_mb": self.bucket_cap_mb, "algorithm": self.algorithm}
        if zero.parameters:
            out.update(prefetch=self.prefetch, reshard_after_forward=self.reshard)
        return out

    def as_json(self) -> dict[str, Any]:
        out = {"stage": self.stage, "kwargs": self.kwargs(), "predicted_step_s": self.step_s,
               "predicted_peak_bytes": self.peak_bytes}
        if self.shard_group:  # the process groups come from commlab.Topology.build(dp=..., shard=...)
            out["shard_group"] = self.shard_group
        return out


def candidates(entry: dict, stages: Iterable[int], algorithms: Sequence[str] | None = None,
               grid_mb: Sequence[float] = GRID_MB, prefetches: Sequence[int] = PREFETCHES,
               optimizer_bytes: float = 0.0) -> list[ShardedCandidate]:
    """Every candidate of the given stages priced from one calibration entry at its world size."""
    from commlab.costmodel.search.predict import (
        UnpriceableConfig,
        costs_from_entry,
        ddp_columns,
        sharded_costs_from_entry,
    )

    world = entry["key"]["world_size"]
    # and caps relative to the model: where memory binds, stage 3 wants buckets well under it
    total_mb = sum(entry["params"]["nbytes"]) / 2**20
    grid_mb = sorted({*grid_mb, *(round(total_mb / k, 6) for k in (2, 4, 8, 16, 32, 64) if total_mb / k > 0)})
    names = list(entry["collectives"]) if algorithms is None else list(algorithms)
    sharded_names = [a for a in names if a in entry["collectives"]
                     and a in entry.get("sharded_collectives", {}).get("reduce_scatter", {})]
    out = []
    for stage in stages:
        if parse_stage(stage).ddp:
            for a in (x for x in names if x in entry["collectives"]):
                costs = costs_from_entry(entry, a, world)
                # DDP's peak (commlab/costmodel/search/predict.py) plus the optimizer state given
                peak = ddp_columns(costs, world, optimizer_bytes)["peak_bytes"]
                for mb in grid_mb:
                    result, buckets = simulate_step(costs, DDPSetting(bucket_cap_mb=mb, first_bucket_mb=mb))
                    out.append(ShardedCandidate(0, a, mb, 0, True, breakdown(result, buckets, costs)[0]["step"], peak))
            continue
        knobs = itertools.product(prefetches, (True, False)) if parse_stage(stage).parameters else [(1, True)]
        # hybrid sharding: every shard group size the calibration measured (commlab/costmodel/calibration/sharded.py)
        shards = [0, *sorted(int(s) for s in entry.get("hybrid_collectives", {}))]
        for a, (prefetch, reshard), shard in itertools.product(sharded_names, list(knobs), shards):
            try:
                costs = sharded_costs_from_entry(entry, a, world, shard or None)
            except UnpriceableConfig:  # an algorithm the shard groups' size refuses
                continue
            for mb in grid_mb:
                setting = ShardedSetting(stage=stage, prefetch=prefetch, reshard=reshard, bucket_cap_mb=mb,
                                         optimizer_bytes=optimizer_bytes)
                result, buckets = simulate_sharded(costs, setting)
                row = sharded_breakdown(result, buckets, costs, setting)[0]
                out.append(ShardedCandidate(stage, a, mb, prefetch, reshard, row["step"], row["peak_bytes"], shard))
    return out


def pick(found: Sequence[ShardedCandidate], memory_bytes: float | None) -> ShardedCandidate:
    """The fastest candidate that fits (ValueError naming the smallest peak when none does)."""
    if not found:
        raise ValueError("no candidate to search: the calibration has no costs for the stages asked "
                         "(calibrate with a sharded configuration, or give --stage 0)")
    fits = [c for c in found if memory_bytes is None or c.peak_bytes <= memory_bytes]
    if not fits:
        small = min(found, key=lambda c: (c.peak_bytes, c.step_s))
        raise ValueError(f"nothing fits in {memory_bytes / 2**30:.3g} GiB per rank: the smallest predicted peak is "
                         f"{small.peak_bytes / 2**30:.3g} GiB ({small.peak_bytes} bytes; stage {small.stage}, "
                         f"bucket {small.bucket_cap_mb:g} MiB, prefetch {small.prefetch}, reshard {small.reshard})")
    best = fits[0]
    for c in fits[1:]:
        if c.step_s < best.step_s * (1 - 1e-9) or (c.step_s <= best.step_s * (1 + 1e-9) and c.peak_bytes < best.peak_bytes):
            best = c
    return best


DEFAULT_MB = 25.0  # ShardedDataParallel's and DDP's default bucket_cap_mb


def default_pick(found: Sequence[ShardedCandidate], memory_bytes: float | None,
                 defaults: dict[int, str]) -> ShardedCandidate:
    """The answer chosen without predicted times: the lowest stage with a candidate that fits
    (fewer collectives per step), then the candidate nearest the defaults (``defaults[stage]``'s
    algorithm, prefetch 1, reshard on, the bucket cap nearest 25 MB); ValueError as :func:`pick`."""
    pick(found, memory_bytes)  # the same errors when nothing fits
    fits = [c for c in found if memory_bytes is None or c.peak_bytes <= memory_bytes]
    stage = min(c.stage for c in fits)
    return min((c for c in fits if c.stage == stage),
               key=lambda c: (c.shard_group != 0, c.algorithm != defaults.get(c.stage), c.prefetch != 1, not c.reshard,
                              abs(math.log(c.bucket_cap_mb / DEFAULT_MB)), c.peak_bytes))


AUTO = "auto"  # the tuner's own choice beside the stages: search every one


def parse_stages(value: int | str) -> tuple[int, ...]:
    """"auto" -> every stage; a stage (commlab/runs/zero_stage.py) -> that one; ValueError otherwise."""
    if isinstance(value, str) and value.strip().lower() == AUTO:
        return STAGES
    try:
        return (parse_stage(value).stage,)
    except ValueError as err:
        raise ValueError(f"{err}; or {AUTO!r}, every stage") from None


def sharded_answer(entry: dict, *, stages: Iterable[int] = STAGES, memory_bytes: float | None = None,
                   algorithms: Sequence[str] | None = None, optimizer_bytes: float = 0.0,
                   force: bool = False) -> dict[str, Any]:
    """The JSON answer of ``commlab tune --stage``: the pick, and per stage the fastest candidate
    that fits (or, where none does, the one with the smallest peak) so that a user sees what
    memory buys. ``chosen_by`` says "search" or, for an unsteady calibration without ``force``,
    "default" (:func:`default_pick`)."""
    stages = tuple(parse_stage(s).stage for s in stages)
    if memory_bytes is not None and not memory_bytes > 0:
        raise ValueError(f"the memory limit must be positive, got {memory_bytes}")
    from commlab.sharded.comm import resolve_algorithm  # what ShardedDataParallel's "auto" runs here

    found = candidates(entry, stages, algorithms, optimizer_bytes=optimizer_bytes)
    steady = entry.get("steadiness", {}).get("steady", True)  # commlab/costmodel/terms/uncertainty.py's verdict
    backend = entry["key"].get("backend", "gloo")
    device = "cpu" if backend == "gloo" else "cuda"
    defaults = {s: "native" if parse_stage(s).ddp else resolve_algorithm("auto", backend, device) for s in STAGES}
    chosen_by = "search" if steady or force else "default"
    best = pick(found, memory_bytes) if chosen_by == "search" else default_pick(found, memory_bytes, defaults)
    per_stage = {}
    for s in stages:  # each stage's fastest that fits, else its smallest peak: what memory buys
        mine = [c for c in found if c.stage == s]
        fits = [c for c in mine if memory_bytes is None or c.peak_bytes <= memory_bytes]
        if mine:
            shown = pick(fits, None) if fits else min(mine, key=lambda c: (c.peak_bytes, c.step_s))
            per_stage[str(s)] = {**shown.as_json(), "fits": bool(fits)}
    return {**best.as_json(), "memory_limit_bytes": memory_bytes, "searched": len(found), "by_stage": per_stage,
            "steady": steady, "chosen_by": chosen_by}
