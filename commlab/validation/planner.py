"""Checking the planner against measurement: run a grid of plans, compare the pick with the best.

The planner's acceptance: its pick, measured, is within 5% of the fastest plan of
a measured grid, and its predicted peak memory bounds the measured one. :func:`measure_rank`
runs on every rank of one launch. All plans are built first, then stepped in rounds, each round
in the opposite order of the one before (plan k never always runs first or after the same
neighbour), so a load change on a shared machine hits every plan alike; each visit steps a plan
twice and times the second, as a training job steps it (after a step of its own). A step's time is the
slowest rank's, from a barrier, without the memory hooks; peak memory is what the allocator saw
in one more step per plan (:func:`commlab.memtrack.track_peak`: allocated minus freed bytes, so
backward's temporaries and the executor's buffers count) plus the rank's parameters and their
gradients, the terms :func:`commlab.costmodel.planner.plan.peak_bytes` predicts.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from typing import Any

from commlab._atomic import write_text
from commlab.costmodel.planner.plan import Plan

from commlab.costmodel.calibration.pipeline import settle, step_of
from commlab.costmodel.planner.model import stage_builder
from commlab.pipeline.schedule.registry import REGISTRY
from commlab.runtime.timer import timed_rounds


def measure_rank(plans: list[dict[str, Any]], common: dict[str, Any]) -> dict[str, Any]:
    """Every plan's step times (one per round) and peak bytes on this rank (run by commlab.launch)."""
    import commlab
    from commlab._malloc import keep_freed_memory
    from commlab.pipeline.runtime.executor import PipelineExecutor

    rt = commlab.Runtime.current()
    # glibc's dynamic mmap threshold rises with the largest block freed, so whether a plan's 1 MB
    # activations come back as fresh pages depended on which plan ran before it (the convnet's
    # interleaved m=8 v=2 measured 78 ms in one run, 106 in another): fixed thresholds, as in the
    # planner's calibration and `commlab bench ddp`.
    keep_freed_memory()
    x, y, loss_fn, build = stage_builder(common)
    built, steps = [], []
    for p in plans:
        placement = REGISTRY[p["schedule"]].placement(rt.world_size, len(p["balance"]))
        model, stage = build(p, placement)
        options = dict(microbatches=p["microbatches"], loss_fn=loss_fn, checkpoint=p["checkpoint"], timeout=common["timeout"])
        built.append((model, stage))
        steps.append(step_of(stage, PipelineExecutor(stage, p["schedule"], track_memory=False, **options), x, y))
    # A training job steps one plan over and over: each visit times a plan's step after one of
    # its own (settle), not right after another plan's, whose memory it would find in cache.
    seconds = timed_rounds(dict(enumerate(steps)), common["iters"], common["warmup"],
                           before=lambda k: settle(built[k][0], steps[k]))["seconds"]
    times = [seconds[k] for k in range(len(plans))]
    rounds = range(common["warmup"], common["warmup"] + common["iters"])
    from commlab.memtrack import track_peak

    peaks = []
    for (_, stage), step in zip(built, steps):
        weights = sum(t.numel() * t.element_size() for t in stage.parameters())
        # What the allocator saw in a step (the executor's ledger misses backward's temporaries
        # and its own buffers): gradients are kept (zero_grad(set_to_none=False)), so the window's
        # rise over its start plus parameters and gradients is the step's peak. The first tracked
        # window can miss frees of blocks allocated before it (commlab/memtrack.py): a second is read.
        with track_peak("cpu"):
            step()
        with track_peak("cpu") as seen:
            step()
        peaks.append(seen.peak_bytes + 2 * weights)  # parameters and their gradients
    # Which timed rounds ran the plans in their forward order (the others: in reverse).
    return {"rank": rt.rank, "times": times, "peaks": peaks, "forward": [i % 2 == 0 for i in rounds]}


def measure_grid(fitting: Sequence[Plan], chosen: Plan, ranks: int, common: dict[str, Any], budget: float | None = None,
                 out=None) -> list[str]:  # fmt: skip
    """Measure every plan of ``fitting`` on ``ranks`` Gloo ranks (:func:`measure_rank`); the report's
    lines (with ``budget`` bytes: judged against the plans whose measured peak fits, :func:`verdict`);
    ``out``: the rows written there as a CSV too."""
    import commlab  # commlab.launch imports torch: loaded only when measuring

    specs = [dict(schedule=p.schedule, microbatches=p.microbatches, checkpoint=p.checkpoint, balance=list(p.balance)) for p in fitting]
    per_rank = commlab.launch(measure_rank, specs, common, world_size=ranks, backend="gloo", timeout=common["timeout"])
    rows = summarise(fitting, chosen, per_rank)
    if out is not None:
        write_rows(out, rows)
    return report(rows, budget)


def summarise(plans: Sequence[Plan], chosen: Plan, per_rank: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per plan: predicted and measured step (slowest rank, median and spread; also the
    medians of the rounds run in forward and in reverse order), peaks."""
    rows = []
    forward = per_rank[0].get("forward") or []
    for k, p in enumerate(plans):
        steps = [max(ts) for ts in zip(*(r["times"][k] for r in per_rank))]
        q = statistics.quantiles(steps, n=4) if len(steps) > 1 else [steps[0]] * 3
        ahead = [t for t, f in zip(steps, forward) if f] or steps
        behind = [t for t, f in zip(steps, forward) if not f] or steps
        measured_peak = [r["peaks"][k] for r in sorted(per_rank, key=lambda r: r["rank"])]
        rows.append(dict(schedule=p.schedule, microbatches=p.microbatches, virtual=p.virtual, checkpoint=p.checkpoint,
                         balance="-".join(map(str, p.balance)), chosen=p == chosen, predicted_s=p.step_time,
                         measured_s=statistics.median(steps), q1_s=q[0], q3_s=q[2],
                         forward_s=statistics.median(ahead), reverse_s=statistics.median(behind),
                         predicted_peak=max(p.peak_bytes), measured_peak=max(measured_peak),
                         peak_bounded=all(a >= b for a, b in zip(p.peak_bytes, measured_peak))))  # fmt: skip
    return rows


def step_errors(rows: Sequence[dict[str, Any]], keys: Sequence[str] = ("forward_s", "reverse_s")) -> dict[str, Any]:
    """The predicted step against the measured one over a checked grid (:func:`summarise`): median
    and worst of |predicted / measured - 1| over every row and each of ``keys`` (default: the
    rounds run in forward order and those run in reverse, each a comparison; ``("measured_s",)``:
    all rounds together), and the row of the worst."""
    def rel(r, key):
        return abs(r["predicted_s"] / r.get(key, r["measured_s"]) - 1.0)

    pairs = [(rel(r, key), r) for r in rows for key in keys]
    worst = max(pairs, key=lambda e: e[0])
    return {"median_abs": statistics.median(e for e, _ in pairs), "worst_abs": worst[0], "worst": worst[1],
            "within_10": sum(e <= 0.10 for e, _ in pairs), "within_25": sum(e <= 0.25 for e, _ in pairs), "count": len(pairs)}


def write_rows(path, rows: Sequence[dict[str, Any]]) -> None:
    """Rows of one shape (a checked grid's, :func:`summarise`; predictions, :func:`prediction_rows`)
    as a CSV at ``path``, atomically."""
    keys = list(rows[0])
    write_text(path, "\n".join([",".join(keys), *(",".join(str(r[k]) for k in keys) for r in rows)]) + "\n")


def verdict(rows: list[dict[str, Any]], budget: float | None = None) -> dict[str, Any]:
    """The pick's measured step over the grid's best, and whether every predicted peak bounds.
    With ``budget`` (bytes per rank), the best is the fastest plan whose *measured* peak fits, and
    ``pick_fits`` says whether the pick's does: rows may then include plans the planner excluded
    (their predicted peak over the budget), so an over-cautious memory model shows too."""
    pick = next(r for r in rows if r["chosen"])
    fits = [r for r in rows if budget is None or r["measured_peak"] <= budget] or rows
    fastest = min(fits, key=lambda r: r["measured_s"])
    return {"pick_over_best": pick["measured_s"] / fastest["measured_s"], "best": fastest, "pick": pick,
            "pick_fits": budget is None or pick["measured_peak"] <= budget,
            "peaks_bounded": all(r["peak_bounded"] for r in rows)}  # fmt: skip


def report(rows: list[dict[str, Any]], budget: float | None = None) -> list[str]:
    """The console table of a checked grid, fastest measured first, and the verdict line."""
    lines = [f"{'schedule':<12} {'m':>3} {'v':>2} {'checkpoint':<12} {'pred ms':>8} {'meas ms':>8} {'q1-q3 ms':>13} "
             f"{'pred MiB':>9} {'meas MiB':>9} bound"]  # fmt: skip
    for r in sorted(rows, key=lambda r: r["measured_s"]):
        lines.append(f"{r['schedule']:<12} {r['microbatches']:>3} {r['virtual']:>2} {r['checkpoint']:<12} {r['predicted_s'] * 1e3:8.2f} "
                     f"{r['measured_s'] * 1e3:8.2f} {r['q1_s'] * 1e3:6.2f}-{r['q3_s'] * 1e3:6.2f} {r['predicted_peak'] / 2**20:9.2f} "
                     f"{r['measured_peak'] / 2**20:9.2f} {'yes' if r['peak_bounded'] else 'NO'}{'  <- pick' if r['chosen'] else ''}")  # fmt: skip
    v = verdict(rows, budget)
    b = v["best"]
    within = f" whose measured peak fits {budget / 2**20:g} MiB" if budget is not None else ""
    fits = f"; the pick's measured peak fits: {'yes' if v['pick_fits'] else 'NO'}" if budget is not None else ""
    lines.append(f"pick measured / best measured{within} = {v['pick_over_best']:.3f} (bar 1.05; best: {b['schedule']} "
                 f"m={b['microbatches']} v={b['virtual']} {b['checkpoint']}){fits}; predicted peak bounds measured on every "
                 f"plan and rank: {'yes' if v['peaks_bounded'] else 'NO'}")  # fmt: skip
    e, a = step_errors(rows), step_errors(rows, ("measured_s",))
    w = e["worst"]
    lines.append(f"step time predicted before the run, against the rounds run forward and those run in reverse "
                 f"({e['count']} comparisons): median |error| {e['median_abs'] * 100:.1f}%, worst {e['worst_abs'] * 100:.1f}% "
                 f"({w['schedule']} m={w['microbatches']} v={w['virtual']} {w['checkpoint']}); within 10%: {e['within_10']}, "
                 f"within 25%: {e['within_25']}; against all rounds together: median {a['median_abs'] * 100:.1f}%, "
                 f"worst {a['worst_abs'] * 100:.1f}%")  # fmt: skip
    return lines


# Predicted before run: ``pipeline plan --predictions`` writes every plan's prediction, a later
# ``pipeline bench`` (same model, --balance uniform or time) measures some of them.
KEY = ("schedule", "microbatches", "virtual", "checkpoint", "balance")


def prediction_rows(plans: Sequence[Plan]) -> list[dict[str, Any]]:
    """One row per plan, keyed as the bench's summary.csv (:data:`KEY`)."""
    return [dict(schedule=p.schedule, microbatches=p.microbatches, virtual=p.virtual, checkpoint=p.checkpoint,
                 balance="-".join(map(str, p.balance)), predicted_s=p.step_time, predicted_peak=max(p.peak_bytes))
            for p in plans]  # fmt: skip


def write_predictions(path, plans: Sequence[Plan]) -> int:
    """:func:`prediction_rows` as a CSV at ``path`` (atomically); returns how many rows."""
    rows = prediction_rows(plans)
    write_rows(path, rows)
    return len(rows)


def against_bench(predictions: Sequence[dict[str, Any]], summary: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every bench row (its ``commlab_s``: the median step) beside the prediction of the same
    configuration, with ``error`` = predicted / measured - 1; a row no prediction matches gets NaN."""
    def key(row):
        return tuple(str(row[k]) for k in KEY)

    predicted = {key(p): float(p["predicted_s"]) for p in predictions}
    out = []
    for row in summary:
        p, measured = predicted.get(key(row), math.nan), float(row["commlab_s"])
        out.append({**{k: row[k] for k in KEY}, "predicted_s": p, "measured_s": measured, "error": p / measured - 1.0})
    return out


def errors(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Median and worst absolute relative error over the rows with a prediction, and how many lacked one."""
    found = [abs(r["error"]) for r in rows if not math.isnan(r["error"])]
    worst = max(rows, key=lambda r: -1.0 if math.isnan(r["error"]) else abs(r["error"]), default=None)
    return {"configurations": len(found), "unmatched": len(rows) - len(found),
            "median_abs": statistics.median(found) if found else math.nan, "worst_abs": max(found, default=math.nan),
            "worst": worst}  # fmt: skip
