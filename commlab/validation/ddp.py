"""Held-out validation of the predictor: calibrate, measure a grid forward and in reverse, compare.

    commlab validate ddp --out results/predict-validation      # 9.9 min measured, 2 cores
    commlab validate ddp --part mlp --part convnet --out ...    # 3.7 min; then
    commlab validate ddp --part blocks --out ...                # 1.9 min
    commlab validate ddp --part oversubscribed --out ...        # 1.6 min (2026-11-26)
    commlab validate ddp --part head --out ...                  # about 2-3 min

The default grid is work the predictor was never developed on (it was built on the default
MLP): a wider, shallower MLP and a conv net given as ``package.module:factory``
(examples/heldout_models.py), bucket sizes 0.5-100 MB, native with overlap on and off and ring
with overlap on, gloo, world size 2; then world sizes 3 and 4 (more ranks than this machine's
cores), reported apart; and (``--part head``) a model with one gradient over glibc's mmap
threshold, native only, buckets 1-64 MB. For each workload, in this order: calibrate (never one of the grid's
configurations), ask the tuner for a bucket (the check: is its measured step within 5% of the
grid's best?), measure the grid plus the recommendation forward, then in reverse. The mean of the
two median step times is what the prediction is judged against; configurations whose two
measurements differ by more than 10% are left out of the worst cases.
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import Any

import pandas as pd

from commlab._atomic import write_text
from commlab.validation import compare
from commlab.costmodel.search import grid_costs as session
from commlab.costmodel.search.predict import write_prediction
from commlab.sweep import runner
from commlab.runs import store
from commlab.runs.grid import Grid, build_grid, merge

CONVNET = "examples.heldout_models:convnet"
# (name, options) of each part; the grid is not full-factorial (ring only with overlap) so that
# it fits in about 10 minutes of a quiet 2-core machine at 12 steps per configuration (9.9 measured).
HELD_OUT = [
    {"model": "mlp", "model_args": "depth=4,width=1536", "algorithm": "native", "overlap": "both"},
    {"model": "mlp", "model_args": "depth=4,width=1536", "algorithm": "ring", "overlap": "on"},
    {"model": CONVNET, "model_args": "channels=48,hidden=4096", "algorithm": "native", "overlap": "both"},
    {"model": CONVNET, "model_args": "channels=48,hidden=4096", "algorithm": "ring", "overlap": "on"},
]
BLOCKS = "examples.heldout_models:blocks"
# Held out from every change of the DDP model so far (the two above were looked at while the
# queue, write-back and fresh-gradient terms were added): transformer blocks, 27 MiB of gradients.
FRESH = [{"model": BLOCKS, "model_args": "d_model=384,layers=4,heads=6,seq=32", "global_batch": 16,
          "algorithm": a, "overlap": o} for a, o in (("native", "both"), ("ring", "on"))]
OVERSUBSCRIBED = [{"model": "mlp", "model_args": "depth=4,width=1536", "algorithm": "native", "overlap": "on",
                   "bucket_mb": "2,25,100", "world_size": w, "global_batch": 48} for w in ("3", "4")]
# Named parts, to split a run that would hold a shared machine too long (--part); each part's
# workloads are calibrated and measured on their own, so parts run apart add up to the whole.
WIDE_HEAD = "examples.heldout_models:wide_head"
# Held out from the retiring of the fitted fresh-gradient rule: one gradient (the 34.2 MiB head)
# over glibc's mmap threshold and over half the largest bucket, native all-reduce only.
HEAD = [{"model": WIDE_HEAD, "model_args": "features=512,width=1280,depth=5,vocab=7000", "global_batch": 32,
         "bucket_mb": "1,4,16,32,64", "algorithm": "native", "overlap": "both"}]
PARTS = {"mlp": HELD_OUT[:2], "convnet": HELD_OUT[2:], "blocks": FRESH, "oversubscribed": OVERSUBSCRIBED,
         "head": HEAD}
TUNED = (CONVNET, WIDE_HEAD)  # workloads whose tuner recommendation is measured too
GRID_MB = "0.5,4,25,100"


def plan_of(options: dict[str, Any], out: Path) -> Grid:
    return build_grid(merge({}, {"bucket_mb": GRID_MB, "global_batch": 64, **options, "out": str(out),
                                 "name": "predicted"}))


def measure_twice(configs, plan: Grid, out: Path, echo) -> pd.DataFrame:
    """The configurations measured forward then in reverse; runs table with the mean step and agreement."""
    tables = []
    for name, order in (("forward", tuple(configs)), ("reverse", tuple(reversed(configs)))):
        run_dir = out / f"measured-{name}"
        runner.run(dataclasses.replace(plan, configs=order, repeat=1), run_dir, resume=False, echo=echo)
        t = store.read_tables(run_dir)[2]
        tables.append(t[t["config"].isin([c.id for c in configs])].set_index("config"))
    a, b = tables
    b = b.reindex(a.index)
    runs = a.copy()
    runs["step_median"] = (a["step_median"] + b["step_median"]) / 2
    runs["agreement"] = (a["step_median"] - b["step_median"]).abs() / runs["step_median"]
    # noise: half the spread of the two measurements, or of p10-p90 if that is wider
    half = ((a["step_median"] - b["step_median"]).abs() / 2).combine((a["step_p90"] - a["step_p10"]) / 2, max)
    runs["step_p10"], runs["step_p90"] = runs["step_median"] - half, runs["step_median"] + half
    return runs.reset_index()


def tune_check(entry: dict, grid: list, echo) -> tuple[Any, dict]:
    """The tuner's recommendation for a workload as a configuration of the grid's kind.

    Only first buckets as large as the others (what an explicit bucket_cap_mb gives in torch and
    what the sweep measures) and caps within the measured grid's 0.5-100 MB."""
    from commlab.costmodel.search.tune import DEFAULT_GRID_MB

    # force: the check judges the search's pick, whatever the calibration's steadiness says
    rec = session.tune_entry(entry, first_buckets=(None,), grid_mb=[m for m in DEFAULT_GRID_MB if m <= 100],
                             with_default=False, force=True)["commlab"]
    base = grid[0]
    cfg = dataclasses.replace(base, bucket_mb=float(rec["ddp_kwargs"]["bucket_cap_mb"]),
                              algorithm=rec["commlab_kwargs"]["algorithm"], overlap=rec["commlab_kwargs"]["overlap"])
    echo(f"tune recommends {cfg.id} (predicted {rec['predicted_step_s'] * 1e3:.1f} ms)")
    return cfg, rec


def validate_parts(parts: list[dict[str, Any]], out: Path, calibration: Path, echo=lambda line: None,
                   tuned: tuple[str, ...] = TUNED) -> dict[str, Any]:
    """Calibrate, tune, measure and predict each workload of ``parts`` in turn; join and report."""
    out = Path(out)
    plans = [plan_of(p, out) for p in parts]
    for plan in plans:
        runner.check_grid(plan)
    groups: dict[tuple, list] = {}
    for plan in plans:
        for cfg in plan.configs:
            groups.setdefault(session.group_key(cfg), []).append(cfg)
    begin, frames, predicted, tunes, entries = time.monotonic(), [], [], [], {}
    for key, grid in groups.items():
        entries.update(session.entries_for(grid, calibration_path=calibration, recalibrate=True, echo=echo))
        extra = []
        if key[0] in tuned:
            cfg, rec = tune_check(entries[key], grid, echo)
            tunes.append({"workload": key, "config": cfg.id, "recommendation": rec})
            extra = [cfg] if cfg.id not in {c.id for c in grid} else []
        measured = measure_twice(grid + extra, plans[0], out, echo)
        frames.append(measured)
        predicted += grid + extra
    measured = pd.concat(frames, ignore_index=True)
    plan = dataclasses.replace(plans[0], configs=tuple(predicted))
    records, meta = session.predict(plan, entries)
    write_prediction(out / "predicted", records, meta)
    both = compare.join(store.read_tables(out / "predicted")[2], measured)
    both = both.merge(measured[["config", "agreement"]], on="config", how="left")
    for t in tunes:  # the recommendation is judged by the tune check, not in the error table
        rows = both[both["config"] == t["config"]]
        model, args, world = t["workload"][0], t["workload"][1], t["workload"][4]
        same = both[(both["model"] == model) & (both["model_args"] == args)
                    & (both["world_size"] == world) & (both["config"] != t["config"])]
        if rows.empty or same.empty:  # a failed run: say so rather than lose the whole validation
            t.update(measured_s=float("nan"), grid_best="", grid_best_s=float("nan"), within=float("nan"),
                     in_interval=False)
            continue
        row, best = rows.iloc[0], same.loc[same["measured_s"].idxmin()]
        low, high = t["recommendation"]["interval_s"]
        t.update(measured_s=float(row["measured_s"]), grid_best=str(best["config"]),
                 grid_best_s=float(best["measured_s"]), within=float(row["measured_s"] / best["measured_s"] - 1),
                 in_interval=bool(low <= row["measured_s"] <= high))
    for t in tunes:
        if t["config"] not in {c.id for c in groups[t["workload"]]}:
            both = both[both["config"] != t["config"]]
    taus = compare.series_taus(both)
    main = both["world_size"] == 2
    table = compare.workload_table(both[main], taus[taus["world_size"] == 2] if len(taus) else taus)
    over = compare.workload_table(both[~main], taus[taus["world_size"] != 2] if len(taus) else taus) \
        if (~main).any() else pd.DataFrame()
    result = {"table": table.to_dict("records"), "oversubscribed": over.to_dict("records"),
              "tune": [{**t, "workload": list(t["workload"])} for t in tunes],
              "calibration_s": {session_key(k): e.get("calibration_s") for k, e in entries.items()},
              "duration_s": time.monotonic() - begin}
    write_text(out / "validation.json", json.dumps(result, indent=1, default=str) + "\n")
    write_text(out / "validation.csv", both.to_csv(index=False, float_format="%.9g"))
    compare.draw(both, out / "predicted_vs_measured")
    echo(compare.report(both, taus))
    echo("held-out, gloo, world size 2 (worst cases over configurations measured twice within 10%):")
    echo(compare.format_table(table))
    if len(over):
        echo("world sizes 3 and 4 (more ranks than cores):\n" + compare.format_table(over))
    for t in tunes:
        rec = t["recommendation"]
        echo(f"tune check {t['workload'][0]}: recommended {t['config']} predicted {rec['predicted_step_s'] * 1e3:.1f} ms "
             f"[{rec['interval_s'][0] * 1e3:.1f}-{rec['interval_s'][1] * 1e3:.1f}], measured {t['measured_s'] * 1e3:.1f} ms "
             f"({'inside' if t['in_interval'] else 'OUTSIDE'} the interval); grid best {t['grid_best']} "
             f"{t['grid_best_s'] * 1e3:.1f} ms: {t['within'] * 100:+.1f}% "
             f"({'within' if t['within'] <= 0.05 else 'NOT within'} 5%)" if t["grid_best"] else
             f"tune check {t['workload'][0]}: {t['config']} or the grid was not measured (see the runs tables)")
    echo(f"validation took {result['duration_s'] / 60:.1f} min -> {out}")
    return {"both": both, "taus": taus, **result}


def session_key(key: tuple) -> str:
    return f"{key[0]} {key[1]} w{key[4]}"
