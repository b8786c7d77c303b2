"""Held-out validation of the sharded predictions: stage x bucket x prefetch, and tune's memory pick.

    commlab validate sharded --out results/sharded-validation   # ~5 min, 2 cores

The default workload is one the sharded lowering was never developed on (it was built on MLPs
and corrected on the conv net of examples/heldout_models.py, ``DEVELOPED_ON``): the GPT of
commlab/models.py, 6 blocks of 384. In this order:
calibrate (the world-size-1 profile, the collective tables, the sharded reduce-scatter and
all-gather tables: never a run of a grid configuration); measure the grid (stages 0-3, bucket
sizes, stage 3's prefetch 0 and 1) forward, then in reverse (commlab/validation/ddp.py's
``measure_twice``); predict it; then the memory check: a per-rank budget at the median of the
measured peaks (it excludes at least a third of the grid, checked), the tuner's pick under that
budget from the calibration alone (stages 0-3, the grid's algorithm), measured both ways like the
grid, against the best measured grid configuration that fits.
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path


from commlab._atomic import write_text
from commlab.validation import compare
from commlab.costmodel.search import grid_costs as session
from commlab.costmodel.search.predict import write_prediction
from commlab.validation.ddp import CONVNET, measure_twice, plan_of
from commlab.sweep import runner
from commlab.runs import store

# The ring runs the sharded collectives (ShardedDataParallel's "auto" on Gloo) and, at stage 0,
# DDP's all-reduce: one algorithm for the whole grid, so that one series is one stage's buckets.
# Plain SGD, as the validation figures in the README and docs/measurements.md were measured (a
# stage sweep's own default is Adam).
HELD_OUT = {"model": "gpt", "model_args": "vocab=8192,d_model=384,layers=6,heads=6,seq=64", "algorithm": "ring",
            "overlap": "on", "bucket_mb": "4,25,100", "stage": "0,1,2,3", "prefetch": "0,1", "global_batch": 16,
            "optimizer": "sgd"}
# The workload the fresh-memory term was found on (so no longer held out): --model and --model-args.
DEVELOPED_ON = {"model": CONVNET, "model_args": "channels=48,hidden=4096", "global_batch": 32}


def tuned_config(entry: dict, grid: list, budget: float, echo):
    """The tuner's pick under ``budget`` bytes per rank, as a configuration of the grid's kind."""
    from commlab.costmodel.search.tune_sharded import candidates, pick
    from commlab.runs.optimizers import state_bytes

    base = grid[0]
    found = [c for c in candidates(entry, (0, 1, 2, 3), (base.algorithm,), prefetches=(0, 1),
                                   optimizer_bytes=state_bytes(base.optim)) if c.reshard]
    best = pick(found, budget)
    echo(f"tune under {budget / 2**20:.1f} MiB picks stage {best.stage}, bucket {best.bucket_cap_mb:g} MB, prefetch "
         f"{best.prefetch}: predicted {best.step_s * 1e3:.1f} ms, peak {best.peak_bytes / 2**20:.1f} MiB")
    prefetch = best.prefetch if best.stage == 3 else 1
    return dataclasses.replace(base, stage=best.stage, bucket_mb=float(best.bucket_cap_mb), prefetch=prefetch), best


def validate(out: Path, calibration: Path, iters: int, echo=lambda line: None, part: dict | None = None) -> dict:
    out = Path(out)
    plan = plan_of({**HELD_OUT, **(part or {}), "iters": iters, "warmup": 2}, out)
    runner.check_grid(plan)
    grid = list(plan.configs)
    begin = time.monotonic()
    entries = session.entries_for(grid, calibration_path=calibration, recalibrate=True, echo=echo)
    measured = measure_twice(grid, plan, out, echo)
    peaks = measured.set_index("config")["peak_bytes"]
    budget = float(peaks.median())
    excluded = float((peaks > budget).mean())
    cfg, best = tuned_config(next(iter(entries.values())), grid, budget, echo)
    if cfg.id in peaks.index:
        tuned = measured[measured["config"] == cfg.id].iloc[0]
    else:
        tuned = measure_twice([cfg], dataclasses.replace(plan, configs=(cfg,)), out / "tuned", echo).iloc[0]
    fits = measured[measured["peak_bytes"] <= budget]
    grid_best = fits.loc[fits["step_median"].idxmin()]
    records, meta = session.predict(plan, entries)
    write_prediction(out / "predicted", records, meta)
    predicted = store.read_tables(out / "predicted")[2]
    both = compare.join(predicted, measured).merge(measured[["config", "agreement"]], on="config", how="left")
    peak_err = (predicted.set_index("config")["peak_bytes"] / peaks - 1).dropna()
    taus = compare.series_taus(both)
    table = compare.workload_table(both, taus)
    check = {"budget_bytes": budget, "grid_excluded": excluded, "pick": cfg.id, "pick_predicted_s": best.step_s,
             "pick_measured_s": float(tuned["step_median"]), "pick_peak_bytes": float(tuned["peak_bytes"]),
             "fits": bool(tuned["peak_bytes"] <= budget), "grid_best": str(grid_best["config"]),
             "grid_best_s": float(grid_best["step_median"]),
             "within": float(tuned["step_median"] / grid_best["step_median"] - 1)}
    result = {"table": table.to_dict("records"), "tune": check,
              "peak_error_median": float(peak_err.abs().median()), "peak_error_worst": float(peak_err.abs().max()),
              "duration_s": time.monotonic() - begin}
    write_text(out / "validation.json", json.dumps(result, indent=1, default=str) + "\n")
    write_text(out / "validation.csv", both.to_csv(index=False, float_format="%.9g"))
    echo(compare.report(both, taus))
    echo("held-out sharded grid, gloo, world size 2 (worst cases over configurations measured twice within 10%):")
    echo(compare.format_table(table))
    echo(f"predicted peak bytes: error median {result['peak_error_median'] * 100:.1f}%, "
         f"worst {result['peak_error_worst'] * 100:.1f}%")
    echo(f"tune check: budget {budget / 2**20:.1f} MiB excludes {excluded * 100:.0f}% of the grid; pick {cfg.id} "
         f"measured {check['pick_measured_s'] * 1e3:.1f} ms, peak {check['pick_peak_bytes'] / 2**20:.1f} MiB "
         f"({'fits' if check['fits'] else 'DOES NOT fit'}); best that fits {check['grid_best']} "
         f"{check['grid_best_s'] * 1e3:.1f} ms: {check['within'] * 100:+.1f}%")
    echo(f"validation took {result['duration_s'] / 60:.1f} min -> {out}")
    return {"both": both, **result}
