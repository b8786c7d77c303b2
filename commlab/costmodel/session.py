"""Glue between a sweep plan and the predictor: which profiles it needs, and its records.

Used by commlab/cli/predict.py and by :func:`commlab.tune`; the pieces it joins (calibration,
lowering, prediction, hardware presets, the search) know nothing of each other.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from commlab.costmodel.calibrate import DEFAULT_PROFILE, Workload, default_threads, profile_for
from commlab.costmodel.profile import key_id
from commlab.sweep.spec import Config

Key = tuple[str, str, int, str, int, int]


def group_key(cfg: Config, world_size: int | None = None) -> Key:
    """What one calibration covers: workload, backend, world size, threads per rank.

    ``world_size`` overrides the configuration's (hardware presets take only the compute of a
    one-rank calibration, which is this machine's CPU: gloo).
    """
    world = cfg.world_size if world_size is None else world_size
    backend = cfg.backend if world_size is None else "gloo"
    threads = getattr(cfg, "threads", None) or default_threads(world)
    return (cfg.model, cfg.model_args, cfg.batch_per_rank, backend, world, int(threads))


def entries_for(configs: Iterable[Config], *, profile_path: Path | None = None, recalibrate: bool = False,
                world_size: int | None = None, echo: Callable[[str], None] = lambda _l: None,
                algorithms: Iterable[str] = ()) -> dict[Key, dict]:
    """One profile entry per group of configurations, calibrating what is missing or stale.
    ``algorithms``: calibrated for every group besides the configurations' own and ``native``."""
    extra = tuple(algorithms)
    wanted: dict[Key, list[str]] = {}
    for cfg in configs:
        group = wanted.setdefault(group_key(cfg, world_size), [])
        for algorithm in ("native", *extra, cfg.algorithm):
            if algorithm not in group:
                group.append(algorithm)
    entries = {}
    for key, names in wanted.items():
        model, model_args, batch, backend, world, threads = key
        entries[key] = profile_for(Workload(model, model_args, batch), backend=backend, world_size=world,
                                   threads=threads, path=profile_path or DEFAULT_PROFILE, recalibrate=recalibrate,
                                   algorithms=tuple(names), echo=echo)
    return entries


def predict(plan, entries: dict[Key, dict], preset: dict | None = None) -> tuple[list[dict], dict[str, Any]]:
    """Records for every configuration of ``plan`` and the run's metadata."""
    from commlab.costmodel.predict import costs_from_entry, predict_plan

    def costs_for(cfg: Config):
        if preset is not None:
            from commlab.costmodel.hardware import costs_on

            return costs_on(preset, entries[group_key(cfg, 1)], cfg.world_size)
        return costs_from_entry(entries[group_key(cfg)], cfg.algorithm, cfg.world_size)

    records = predict_plan(plan.configs, costs_for)
    note = ("PREDICTED by commlab predict from calibration profile(s) "
            + ", ".join(key_id(e["key"]) for e in entries.values()))
    if preset is not None:
        note = f"PREDICTED for hardware preset {preset['name']}: {preset['assumptions']}"
    meta = {"source": "predicted", "figure_note": note,
            "profiles": {key_id(e["key"]): {"key": e["key"], "created": e["created"]} for e in entries.values()},
            "hardware": preset}
    return records, meta


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
    """The two recommendations (commlab/costmodel/tuning.py) for one profile entry, as JSON-ready
    data. ``algorithms``: those searched (default: every calibrated one); the entry's steadiness
    (commlab/costmodel/uncertainty.py) widens the intervals and, unless ``force``, withholds a pick."""
    # Lazy, as predict() below: the lowering pulls in the sweep's tables (pandas); CLI start-up.
    from commlab.costmodel.predict import costs_from_entry
    from commlab.costmodel.tuning import answer, search
    from commlab.costmodel.uncertainty import Steadiness

    world = world_size or entry["key"]["world_size"]
    names = list(entry["collectives"]) if algorithms is None else list(dict.fromkeys(algorithms))
    costs = {a: costs_from_entry(entry, a, world) for a in names}
    steadiness = Steadiness.from_json(entry["steadiness"]) if "steadiness" in entry else None
    return answer(search(costs, **search_options), steadiness, force=force)


def tune_algorithms() -> tuple[str, ...]:
    """What `commlab tune` searches: every registered all-reduce algorithm, whatever a cache holds."""
    from commlab.collectives import algorithm_names  # lazy: it imports torch (CLI start-up)

    return tuple(algorithm_names())
