"""Glue between a sweep plan and the predictor: which calibrations it needs, and its records.

Used by commlab/cli/predict.py and by :func:`commlab.tune`; the pieces it joins (calibration,
lowering, prediction, hardware presets, the search) know nothing of each other.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from commlab.costmodel.calibration.driver import DEFAULT_CALIBRATION, Workload, calibration_for, default_threads
from commlab.costmodel.calibration.cache import key_id
from commlab.costmodel.lowering.ddp import step_costs
from commlab.runs.config import Config, optimizer_of, zero_stage_of

Key = tuple[str, str, int, str, int, int, str]


def group_key(cfg: Config, world_size: int | None = None) -> Key:
    """What one calibration covers: workload, backend, world size, threads per rank, optimizer.

    ``world_size`` overrides the configuration's (hardware presets take only the compute of a
    one-rank calibration, which is this machine's CPU: gloo).
    """
    world = cfg.world_size if world_size is None else world_size
    backend = cfg.backend if world_size is None else "gloo"
    threads = getattr(cfg, "threads", None) or default_threads(world)
    return (cfg.model, cfg.model_args, cfg.batch_per_rank, backend, world, int(threads), optimizer_of(cfg))


def entries_for(configs: Iterable[Config], *, calibration_path: Path | None = None, recalibrate: bool = False,
                world_size: int | None = None, echo: Callable[[str], None] = lambda _l: None,
                algorithms: Iterable[str] = (), shard: bool = False) -> dict[Key, dict]:
    """One calibration entry per group of configurations, calibrating what is missing or stale.
    ``algorithms``: calibrated for every group besides the configurations' own and ``native``;
    a group with a configuration at stage 1-3 (or every group, ``shard``) gets the reduce-scatter
    and all-gather tables too."""
    extra = tuple(algorithms)
    wanted: dict[Key, list[str]] = {}
    sharded: set[Key] = set()  # groups with a configuration at stage 1-3: they need the sharded tables
    for cfg in configs:
        group = wanted.setdefault(group_key(cfg, world_size), [])
        if not zero_stage_of(cfg).ddp or shard:
            sharded.add(group_key(cfg, world_size))
        for algorithm in ("native", *extra, cfg.algorithm):
            if algorithm not in group:
                group.append(algorithm)
    entries = {}
    for key, names in wanted.items():
        model, model_args, batch, backend, world, threads, optimizer = key
        entries[key] = calibration_for(Workload(model, model_args, batch, optimizer), backend=backend, world_size=world,
                                       threads=threads, path=calibration_path or DEFAULT_CALIBRATION,
                                       recalibrate=recalibrate, algorithms=tuple(names), echo=echo,
                                       sharded=key in sharded)
    return entries


def predict(plan, entries: dict[Key, dict]) -> tuple[list[dict], dict[str, Any]]:
    """Records for every configuration of ``plan`` and the run's metadata."""
    from commlab.costmodel.search.predict import costs_for_config, predict_plan

    records = predict_plan(plan.configs, lambda cfg: costs_for_config(entries[group_key(cfg)], cfg))
    note = ("PREDICTED by commlab predict from calibration(s) "
            + ", ".join(key_id(e["key"]) for e in entries.values()))
    meta = {"source": "predicted", "figure_note": note,
            "calibrations": {key_id(e["key"]): {"key": e["key"], "created": e["created"]} for e in entries.values()},
            "hardware": None}
    return records, meta


def predict_on(plan, preset: dict, calibration_path: Path | None = None,
               echo: Callable[[str], None] = lambda _l: None) -> tuple[list[dict], dict[str, Any]]:
    """Records for ``plan`` on a hardware preset (commlab/costmodel/hardware/presets.py): nothing is
    calibrated here; each workload's compute is a calibration made on the preset's device when
    ``calibration_path`` holds one, else its FLOPs. DDP (stage 0) through the DDP lowering, ZeRO
    stages 1-3 through the sharded one, on the preset's all-reduce, reduce-scatter and all-gather
    (one world packed on whole nodes; no fresh-page cost: a GPU's caching allocator reuses memory)."""
    # Lazy: FLOPs counting and the lowering import torch and pandas (CLI start-up).
    from commlab.costmodel.hardware import flops, presets as hardware
    from commlab.costmodel.lowering.zero import sharded_costs
    from commlab.costmodel.terms.costs import Overheads
    from commlab.costmodel.search.predict import predict_plan, profile_from_entry

    computes: dict[tuple, tuple] = {}
    for cfg in plan.configs:
        key = (cfg.model, cfg.model_args, cfg.batch_per_rank, optimizer_of(cfg))
        if key in computes:
            continue
        entry = device_entry(calibration_path or DEFAULT_CALIBRATION, *key[:3], device=str(preset["device"]),
                             optimizer=key[3])
        if entry is not None:
            c = entry["compute"]
            computes[key] = (profile_from_entry(entry), Overheads(c["bucket_fixed_s"], c["writeback_s_per_byte"]),
                             f"compute measured on {c['device_name']} (calibration {key_id(entry['key'])})")
        else:
            counted = flops.count(cfg.model, cfg.model_kwargs(), cfg.batch_per_rank)
            profile, overheads = hardware.compute_from_flops(preset, counted)
            computes[key] = (profile, overheads, flops.describe(counted, float(preset["peak_tflops"]) * 1e12,
                                                                float(preset["compute_fraction"]), cfg.batch_per_rank)
                             + f"; optimizer and write-back as memory traffic at {preset['hbm_gbps']} GB/s")
        echo(f"{cfg.model} {cfg.model_args}: {computes[key][2]}")

    def costs_for(cfg: Config):
        profile, overheads, _ = computes[(cfg.model, cfg.model_args, cfg.batch_per_rank, optimizer_of(cfg))]
        shard = getattr(cfg, "shard_group", 0) or None
        system = hardware.system_on(preset, overheads, cfg.world_size, shard=shard)
        if zero_stage_of(cfg).ddp:
            return step_costs(system, profile, "native", cfg.world_size)
        return sharded_costs(system, profile, "native", cfg.world_size, shard=shard)

    records = predict_plan(plan.configs, costs_for)
    said = "; ".join(dict.fromkeys(c[2] for c in computes.values()))
    note = f"PREDICTED for hardware preset {preset['name']}: {hardware.assumptions(preset, said)}"
    return records, {"source": "predicted", "figure_note": note, "calibrations": {}, "hardware": preset}


def device_entry(path: Path, model: str, model_args: str, batch_per_rank: int, *, device: str,
                 optimizer: str = "sgd") -> dict | None:
    """The newest world-size-1 NCCL calibration entry of this workload and optimizer made on a
    device whose name holds ``device`` (made on any machine: that is the point), or None."""
    from commlab.costmodel.calibration.cache import check_entry, key_optimizer, read_file

    found = []
    for entry in read_file(path).values():
        k, c = entry.get("key", {}), entry.get("compute", {})
        if (k.get("model"), k.get("model_args"), k.get("batch_per_rank"), k.get("world_size"), k.get("backend")) \
                == (model, model_args, batch_per_rank, 1, "nccl") and device in str(c.get("device_name", "")) \
                and key_optimizer(k) == optimizer:
            check_entry(entry, f"{path} [{key_id(k)}]")
            found.append(entry)
    return max(found, key=lambda e: e["created"]) if found else None


def holds_measured(run_dir: Path) -> bool:
    """Whether ``run_dir`` holds a sweep's records that are not a prediction's."""
    meta = Path(run_dir) / "metadata.json"
    if not any((Path(run_dir) / "configs").glob("*.json")):
        return False
    return not meta.exists() or json.loads(meta.read_text()).get("source") != "predicted"


def check_run_dir(run_dir: Path) -> None:
    """A prediction may replace an earlier prediction, never a measured sweep's results."""
    if any((Path(run_dir) / "configs").glob("*.json")):
        if holds_measured(run_dir):
            raise ValueError(f"{run_dir} holds measured results: pick another --name or --out")
        for old in (Path(run_dir) / "configs").glob("*.json"):
            old.unlink()


def tune_entry(entry: dict, world_size: int | None = None, *, algorithms: Iterable[str] | None = None,
               force: bool = False, **search_options) -> dict[str, Any]:
    """The two recommendations (commlab/costmodel/search/tune.py) for one calibration entry, as JSON-ready
    data. ``algorithms``: those searched (default: every calibrated one); the entry's steadiness
    (commlab/costmodel/terms/uncertainty.py) widens the intervals and, unless ``force``, withholds a pick."""
    # Lazy, as predict() below: the lowering pulls in the sweep's tables (pandas); CLI start-up.
    from commlab.costmodel.search.predict import costs_from_entry
    from commlab.costmodel.search.tune import answer, search
    from commlab.costmodel.terms.uncertainty import Steadiness

    world = world_size or entry["key"]["world_size"]
    names = list(entry["collectives"]) if algorithms is None else list(dict.fromkeys(algorithms))
    costs = {a: costs_from_entry(entry, a, world) for a in names}
    steadiness = Steadiness.from_json(entry["steadiness"]) if "steadiness" in entry else None
    return answer(search(costs, **search_options), steadiness, force=force)


def tune_algorithms() -> tuple[str, ...]:
    """What `commlab tune` searches: every registered all-reduce algorithm, whatever a cache holds."""
    from commlab.collectives import algorithm_names  # lazy: it imports torch (CLI start-up)

    return tuple(algorithm_names())
