"""Checking the layout planner against measurement: every layout of a world, stepped in alternating rounds.

:func:`measure_rank` builds every plan on every rank of one launch (tensor parallelism by
:func:`commlab.tensor.parallelize` over the world, data parallelism by commlab's DDP, pipelines
by the pipeline runtime as :mod:`commlab.validation.planner` builds them), then steps them in
rounds, each round in the opposite order of the one before, each visit after one untimed step of
its own, as the pipeline planner's check does; a step's time is the slowest rank's. Peak memory:
what the allocator saw in a step plus the rank's parameters and gradients, and what DDP
allocated when built (its bucket buffers, held for the job's life).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

from commlab.costmodel.planner.layout_search import LayoutPlan


def _accumulate_step(spec: dict[str, Any], common: dict[str, Any], rt):
    """A layout without a pipeline: its model and a step of ``m`` accumulated micro-batches."""
    import torch

    import commlab
    from commlab.costmodel.planner.split import checkpoint_blocks
    from commlab.models import build_workload
    from commlab.tensor import parallelize

    torch.manual_seed(0)
    workload = build_workload(common["model"], **common.get("sizes", {}))
    model = workload.model
    if spec["tp"] > 1:
        parallelize(model, common["plan"])
    if spec["checkpoint"] == "always":
        checkpoint_blocks(model)
    x, y = workload.make_batch(common["batch"], torch.Generator().manual_seed(1))
    held = 0
    if spec["dp"] > 1:
        from commlab.memtrack import track_peak

        with track_peak("cpu") as built:  # what DDP keeps beside the model: its flat bucket buffers
            model = commlab.DistributedDataParallel(model)
        held = built.net_bytes
        x, y = x.chunk(spec["dp"])[rt.rank], y.chunk(spec["dp"])[rt.rank]
    xs, ys = x.chunk(spec["microbatches"]), y.chunk(spec["microbatches"])

    def step() -> None:
        for i, (xi, yi) in enumerate(zip(xs, ys)):
            if spec["dp"] > 1:  # DDP reduces once, in the last micro-batch's backward (torch's no_sync)
                model.require_backward_grad_sync = i == len(xs) - 1
            workload.loss_fn(model(xi), yi).backward()

    return model, step, held


def measure_rank(specs: list[dict[str, Any]], common: dict[str, Any]) -> dict[str, Any]:
    """Every plan's step times (one per timed round) and peak bytes on this rank (commlab.launch)."""
    import torch.distributed as dist

    import commlab
    from commlab._malloc import keep_freed_memory
    from commlab.costmodel.calibration.pipeline import settle, step_of
    from commlab.costmodel.planner.model import stage_builder
    from commlab.memtrack import track_peak
    from commlab.pipeline.runtime.executor import PipelineExecutor
    from commlab.pipeline.schedule.registry import REGISTRY
    from commlab.runtime.timer import timed_rounds

    rt = commlab.Runtime.current()
    keep_freed_memory()  # as the pipeline planner's check (commlab/validation/planner.py)
    built, steps = [], []
    pipe = stage_builder(common) if any(s["pp"] > 1 for s in specs) else None
    for s in specs:
        if s["pp"] == 1:
            model, step, held = _accumulate_step(s, common, rt)
            holder = model
        else:
            x, y, loss_fn, build = pipe
            placement = REGISTRY[s["schedule"]].placement(rt.world_size, len(s["balance"]))
            model, stage = build(s, placement)
            executor = PipelineExecutor(stage, s["schedule"], track_memory=False, microbatches=s["microbatches"],
                                        loss_fn=loss_fn, checkpoint=s["checkpoint"], timeout=common["timeout"])  # fmt: skip
            holder, step, held = stage, step_of(stage, executor, x, y), 0
        built.append((model, holder, held))
        steps.append(step)
    seconds = timed_rounds(dict(enumerate(steps)), common["iters"], common["warmup"],
                           before=lambda k: settle(built[k][0], steps[k]))["seconds"]  # fmt: skip
    peaks = []
    for (_, holder, held), step in zip(built, steps):
        weights = sum(p.numel() * p.element_size() for p in holder.parameters())
        dist.barrier()
        with track_peak("cpu"):
            step()
        with track_peak("cpu") as seen:
            step()
        peaks.append(seen.peak_bytes + 2 * weights + held)
    rounds = range(common["warmup"], common["warmup"] + common["iters"])
    return {"rank": rt.rank, "times": [seconds[k] for k in range(len(specs))], "peaks": peaks,
            "forward": [i % 2 == 0 for i in rounds]}  # fmt: skip


def spec_of(p: LayoutPlan) -> dict[str, Any]:
    return dict(tp=p.layout.tp, pp=p.layout.pp, dp=p.layout.dp, schedule=p.schedule, microbatches=p.microbatches,
                checkpoint=p.checkpoint, balance=list(p.balance))  # fmt: skip


def measure(plans: Sequence[LayoutPlan], world: int, common: dict[str, Any]) -> list[dict[str, Any]]:
    """Every plan measured on ``world`` Gloo ranks (:func:`measure_rank`): one row each, predicted
    and measured step (median of all rounds, and of the forward and the reverse rounds) and peaks."""
    import commlab

    per_rank = commlab.launch(measure_rank, [spec_of(p) for p in plans], common, world_size=world, backend="gloo",
                              timeout=common["timeout"])  # fmt: skip
    forward = per_rank[0]["forward"]
    rows = []
    for k, p in enumerate(plans):
        steps = [max(ts) for ts in zip(*(r["times"][k] for r in per_rank))]
        ahead = [t for t, f in zip(steps, forward) if f] or steps
        behind = [t for t, f in zip(steps, forward) if not f] or steps
        rows.append(dict(plan=p, predicted_s=p.step_time, measured_s=statistics.median(steps),
                         forward_s=statistics.median(ahead), reverse_s=statistics.median(behind),
                         predicted_peak=p.peak_bytes, measured_peak=max(r["peaks"][k] for r in per_rank)))  # fmt: skip
    return rows


def report(rows: Sequence[dict[str, Any]], chosen: LayoutPlan, budget: float) -> list[str]:
    """The table of predicted against measured, the pick against the fastest whose measured peak
    fits ``budget``, and the median and worst step error (forward and reverse rounds each a comparison)."""
    lines = [f"{'plan':<44} {'pred ms':>8} {'meas ms':>8} {'err':>6} {'pred MiB':>9} {'meas MiB':>9}"]
    for r in sorted(rows, key=lambda r: r["measured_s"]):
        mark = " <- pick" if r["plan"] == chosen else ""
        fits = "" if r["measured_peak"] <= budget else " (over budget)"
        lines.append(f"{r['plan'].describe():<44} {r['predicted_s'] * 1e3:8.2f} {r['measured_s'] * 1e3:8.2f} "
                     f"{r['predicted_s'] / r['measured_s'] - 1:+6.1%} {r['predicted_peak'] / 2**20:9.2f} "
                     f"{r['measured_peak'] / 2**20:9.2f}{fits}{mark}")  # fmt: skip
    errors = sorted(abs(r["predicted_s"] / r[k] - 1) for r in rows for k in ("forward_s", "reverse_s"))
    fits = [r for r in rows if r["measured_peak"] <= budget] or list(rows)
    fastest = min(fits, key=lambda r: r["measured_s"])
    pick = next(r for r in rows if r["plan"] == chosen)
    lines.append(f"step error: median {statistics.median(errors):.1%}, worst {errors[-1]:.1%} over {len(errors)} comparisons")
    lines.append(f"pick {chosen.describe()}: measured {pick['measured_s'] * 1e3:.2f} ms = "
                 f"{pick['measured_s'] / fastest['measured_s']:.3f} x the fastest that fits ({fastest['plan'].describe()})")  # fmt: skip
    return lines
