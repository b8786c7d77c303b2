"""Predicting a sweep: each configuration of a plan simulated from a calibration.

    records = predict_plan(plan, costs_for)     # one sweep record per configuration, no process

A prediction is written exactly as a measured sweep writes its results (commlab/runs/store.py:
the same records, CSVs, columns and configuration ids), plus a ``source`` column saying
``predicted``, so that every figure and ``commlab trace`` work on it unchanged.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from commlab.costmodel.terms.costs import (
    CollectiveCost,
    Contention,
    DDPProfile,
    Overheads,
    SystemCosts,
    cost_from_entry,
)
from commlab.costmodel.lowering.ddp import DDPSetting, StepCosts, breakdown, simulate_step, step_costs
from commlab.costmodel.lowering.zero import (
    REPLICATE,
    ShardedCosts,
    ShardedSetting,
    sharded_breakdown,
    sharded_costs,
    simulate_sharded,
)
from commlab.runs.traffic import comm_bytes
from commlab.runs.config import LATER_FIELDS, Config, optimizer_of, zero_stage_of
from commlab.runs.optimizers import state_bytes
from commlab.runs.store import MEASURE_COLUMNS

SOURCE = "predicted"
# stage 3's keys, as records written before they were columns hold them (the stage: zero_stage_of)
SHARDED_DEFAULTS = {k: LATER_FIELDS[k] for k in ("prefetch", "reshard")}


class UnpriceableConfig(ValueError):
    """A configuration the model has no cost for (say, an algorithm or backend never calibrated)."""


def system_from_entry(entry: dict, world_size: int) -> SystemCosts:
    """What one calibration entry (commlab/costmodel/calibration/cache.py) measured about the machine,
    its all-reduce tables priced at ``world_size`` (the entry's own)."""
    c = entry["compute"]
    contention = {}
    for algorithm in entry["collectives"]:
        k = entry["contention"].get(algorithm, {"kc": 0.0, "km": 0.0})
        # optional (calibrations made before it was measured price one collective at a time)
        lanes = entry.get("concurrency", {}).get(algorithm, {"lanes": 1, "gain": 1.0})
        paired = CollectiveCost(tuple(lanes["sizes"]), tuple(lanes["paired_s"])) if "paired_s" in lanes else None
        contention[algorithm] = Contention(k["kc"], k["km"], int(lanes["lanes"]), float(lanes["gain"]), paired,
                                           k.get("kc_copy"), k.get("km_copy"))
    tables = {("allreduce", a, world_size): cost_from_entry(t) for a, t in entry["collectives"].items()}
    for collective, by_algorithm in entry.get("sharded_collectives", {}).items():  # reduce_scatter, all_gather
        tables.update({(collective, a, world_size): cost_from_entry(t) for a, t in by_algorithm.items()})
    # hybrid sharding: each shard group size's tables, measured with every group running at once
    for shard, kinds in entry.get("hybrid_collectives", {}).items():
        for collective, by_algorithm in kinds.items():  # the replicas' all-reduce is over world / shard ranks
            size = world_size // int(shard) if collective == REPLICATE else int(shard)
            tables.update({(collective, a, size): cost_from_entry(t) for a, t in by_algorithm.items()})
    return SystemCosts(
        collectives=tables,
        contention=contention, corun=c["corun"],
        corun_optimizer=c.get("corun_optimizer"), corun_copy=c.get("corun_copy"),  # optional: newer entries
        overheads=Overheads(bucket_fixed_s=c["bucket_fixed_s"], writeback_s_per_byte=c["writeback_s_per_byte"]))


def profile_from_entry(entry: dict) -> DDPProfile:
    """The workload's compute profile from one calibration entry."""
    c, p = entry["compute"], entry["params"]
    return DDPProfile(forward_s=c["forward_s"], ready_s=tuple(c["ready_s"]), ready_order=tuple(p["ready_order"]),
                      param_nbytes=tuple(p["nbytes"]), optimizer_s=c["optimizer_s"], nosync_s=c["nosync_s"])


def costs_from_entry(entry: dict, algorithm: str, world_size: int) -> StepCosts:
    """The lowering's costs from one calibration entry (commlab/costmodel/calibration/cache.py)."""
    if algorithm not in entry["collectives"]:
        raise UnpriceableConfig(f"no all-reduce cost for algorithm {algorithm!r} in the calibration "
                                f"(calibrated: {', '.join(sorted(entry['collectives'])) or 'none'})")
    return step_costs(system_from_entry(entry, world_size), profile_from_entry(entry), algorithm, world_size,
                      activation_bytes=entry["compute"].get("activation_bytes", 0))


def sharded_costs_from_entry(entry: dict, algorithm: str, world_size: int, shard: int | None = None) -> ShardedCosts:
    """The sharded lowering's costs from one calibration entry (one with its sharded tables; with
    ``shard`` < ``world_size``, hybrid sharding, its tables for that shard group size)."""
    have = entry.get("sharded_collectives", {}).get("reduce_scatter", {})
    if algorithm not in have or algorithm not in entry["collectives"]:
        raise UnpriceableConfig(f"no reduce-scatter/all-gather cost for algorithm {algorithm!r} in the calibration "
                                f"(calibrated: {', '.join(sorted(have)) or 'none'}): calibrate again")
    hybrid = entry.get("hybrid_collectives", {})
    if shard and shard != world_size and algorithm not in hybrid.get(str(shard), {}).get(REPLICATE, {}):
        raise UnpriceableConfig(f"no hybrid-sharding costs for shard groups of {shard} ({algorithm!r}) in the "
                                f"calibration (has: {', '.join(sorted(hybrid)) or 'none'}): calibrate again "
                                "(a sharded calibration measures every shard group size of its world)")
    fresh = entry["compute"].get("fresh_memory")  # absent from calibrations made before it was measured
    return sharded_costs(system_from_entry(entry, world_size), profile_from_entry(entry), algorithm, world_size,
                         activation_bytes=entry["compute"].get("activation_bytes", 0),
                         fresh=cost_from_entry(fresh) if fresh else None, rows=entry["params"].get("rows"),
                         backend=entry["key"].get("backend"), shard=shard)


def knob(cfg: Any, name: str) -> Any:
    """A sweep configuration's sharded key (a Config or a dict), with the shared defaults."""
    default = SHARDED_DEFAULTS[name]
    return cfg.get(name, default) if isinstance(cfg, dict) else getattr(cfg, name, default)


def sharded_setting_of(cfg: Config) -> ShardedSetting:
    return ShardedSetting(stage=zero_stage_of(cfg).stage, prefetch=int(knob(cfg, "prefetch")),
                          reshard=bool(knob(cfg, "reshard")), bucket_cap_mb=cfg.bucket_mb,
                          accumulate=cfg.accumulate, policy=cfg.bucket_policy,
                          optimizer_bytes=state_bytes(optimizer_of(cfg)))


def costs_for_config(entry: dict, cfg: Config) -> StepCosts | ShardedCosts:
    """Stage 0 (commlab DDP): the DDP lowering's costs; stages 1-3: the sharded lowering's."""
    if zero_stage_of(cfg).ddp:
        return costs_from_entry(entry, cfg.algorithm, cfg.world_size)
    return sharded_costs_from_entry(entry, cfg.algorithm, cfg.world_size, getattr(cfg, "shard_group", 0) or None)


def setting_of(cfg: Config) -> DDPSetting:
    return DDPSetting(bucket_cap_mb=cfg.bucket_mb, overlap=cfg.overlap, accumulate=cfg.accumulate, groups=cfg.groups,
                      policy=cfg.bucket_policy)


def predict_config(cfg: Config, costs: StepCosts, setting: DDPSetting | None = None) -> dict[str, Any]:
    """The prediction record (commlab/runs/store.py:record) of one simulated configuration: every
    rank gets the same rows (ranks are symmetric in the model), one iteration each."""
    from commlab.runs.store import record

    started = time.time()
    if isinstance(costs, ShardedCosts):
        chosen = sharded_setting_of(cfg)
        result, buckets = simulate_sharded(costs, chosen)
        row, bucket_rows = sharded_breakdown(result, buckets, costs, chosen)
    else:
        result, buckets = simulate_step(costs, setting or setting_of(cfg))
        row, bucket_rows = breakdown(result, buckets, costs)
        row.update(ddp_columns(costs, cfg.world_size, state_bytes(optimizer_of(cfg))))
    results = [{"rank": r, "host": "predicted", "device": "predicted",
                "iterations": [{"rank": r, "iteration": 0, **row}],
                "buckets": [{"rank": r, "iteration": 0, **b} for b in bucket_rows]}
               for r in range(cfg.world_size)]
    return record(cfg, started, results, measures={c: row[c] for c in MEASURE_COLUMNS}, source=SOURCE)


def ddp_columns(costs: StepCosts, world_size: int, optimizer_bytes: float = 0.0) -> dict[str, float]:
    """The sharded columns of a stage-0 (DDP) step: the ZeRO model's stage 0 in fp32 with
    ``optimizer_bytes`` of optimizer state per parameter (commlab/runs/optimizers.py: 0 for plain
    SGD, 8 for Adam), plus DDP's bucket buffers (a second copy of the gradients: the
    default gradient_as_bucket_view=False writes clones back, commlab/ddp/bucket.py as torch's
    reducer), plus the larger of the profile's activations (backward) and the optimizer step's
    temporaries of the largest parameter (commlab/sharded/memory_model.py's step_temporaries); and
    the all-reduce's 2 (N-1)/N of the gradients sent."""
    from commlab.sharded.memory_model import step_temporaries  # lazy: commlab.sharded imports torch

    total = sum(costs.param_nbytes)
    sent = int(round(comm_bytes([("all_reduce", total)], world_size)))
    state = int(optimizer_bytes * total / 4)  # fp32: total / 4 parameters
    step = step_temporaries(optimizer_bytes) * max(costs.param_nbytes, default=0)
    return {"peak_bytes": 3 * total + state + max(costs.activation_bytes, step), "comm_bytes": sent,
            "exposed_allgather": 0.0, "exposed_reducescatter": 0.0}


def predict_plan(configs, costs_for: Callable[[Config], StepCosts | ShardedCosts]) -> list[dict[str, Any]]:
    """Records for every configuration; one that cannot be priced is an error before any is written."""
    priced = [(cfg, costs_for(cfg)) for cfg in configs]
    return [predict_config(cfg, costs) for cfg, costs in priced]


def table(records: list[dict[str, Any]]) -> str:
    """The configurations as a text table: predicted step time, exposed communication (end of
    backward to the last bucket done, commlab/ddp/timing.py's definition; at stages 1-3 the
    waits on all-gathers and reductions), bucket count, stage, prefetch and peak bytes per rank."""
    head = ("configuration", "step ms", "exposed comm ms", "buckets", "stage", "prefetch", "peak MiB")
    rows = []
    for rec in records:
        it = rec["iterations"][0]  # ranks are symmetric in the model: rank 0's row stands for all
        buckets = sum(1 for b in rec["buckets"] if b["rank"] == 0)
        zero = zero_stage_of(rec["config"])
        rows.append((rec["config"]["config"], f"{it['step'] * 1e3:.1f}", f"{it['exposed_comm'] * 1e3:.1f}", str(buckets),
                     str(zero.stage), str(knob(rec["config"], "prefetch")) if zero.parameters else "-",
                     f"{it['peak_bytes'] / 2**20:.1f}"))
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    line = lambda r: "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))  # noqa: E731
    return "\n".join([line(head), *(line(r) for r in rows)])


def write_prediction(run_dir: Path, records: list[dict[str, Any]], meta: dict[str, Any]) -> None:
    """Records and CSVs as a sweep writes them, then the ``source`` column on every table."""
    from commlab.runs import store

    run_dir = Path(run_dir)
    for rec in records:
        store.save_record(run_dir, rec)
    store.assemble(run_dir, source=SOURCE)
    store.write_metadata(run_dir, meta)

