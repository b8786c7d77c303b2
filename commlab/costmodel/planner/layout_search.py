"""The layout planner: every (tp, pp, dp) x micro-batches x schedule x recompute of a world, predicted.

A layout without a pipeline (pp 1) accumulates ``m`` micro-batches on each rank: its tensor-
parallel share is profiled in one process at the split shapes (:mod:`commlab.costmodel.planner.split`)
at the micro-batch ``batch / (dp m)``, every block checkpointed where recompute is "always", and
lowered onto the simulator core with its collectives and DDP's buckets
(:func:`commlab.costmodel.planner.layouts.tp_tasks`). A pipeline layout (pp > 1, tp 1) is the
pipeline planner's (:func:`commlab.costmodel.planner.plan.candidates`, its profile and lowering),
with data parallelism over its replicas. Costs (the all-reduce table of the group size, the
point-to-point line) come from one calibration of the model's sizes
(:func:`commlab.costmodel.planner.calibrate`), never from a run of a layout.
"""

from __future__ import annotations

import os
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from commlab.costmodel.lowering.pipeline import DataParallel
from commlab.costmodel.planner.layouts import Layout, SplitProfile, layouts, peak_bytes, step_time
from commlab.costmodel.terms.costs import SystemCosts

ACCUMULATE = "accumulate"  # the schedule of a layout without a pipeline: micro-batches one after another
RECOMPUTE = {"never": False, "always": True}


@dataclass(frozen=True)
class LayoutPlan:
    layout: Layout
    schedule: str
    microbatches: int
    checkpoint: str
    step_time: float
    peak_bytes: float  # the largest rank's
    balance: tuple[int, ...] = ()

    def describe(self) -> str:
        return f"{self.layout} {self.schedule} m={self.microbatches} checkpoint {self.checkpoint}"


def model_plan(name: str, sizes: Mapping, plan: str | None) -> tuple[dict[str, str], int | None]:
    """The tensor-parallel plan (``package.module:function``'s, or for the built-in GPT
    :func:`commlab.tensor.gpt_plan`) and the model's head count (its ``heads`` attribute, if any)."""
    from commlab.models import build_workload, import_user_module
    from commlab.tensor import gpt_plan

    if plan is None:
        if name != "gpt":
            raise ValueError("name the model's tensor-parallel plan (package.module:function)")
        found = gpt_plan()
    else:
        found = dict(getattr(import_user_module(plan), plan.partition(":")[2])())
    model = build_workload(name, **sizes).model
    heads = getattr(model, "heads", None)
    if heads is None and name == "gpt":
        heads = model.layers[0].heads
    return found, heads


def check_plan(name: str, sizes: Mapping, plan: Mapping[str, str], among: Sequence[Layout]) -> None:
    """ValueError if ``plan`` does not split the model at some layout's tp (a pattern naming no
    module, a size tp does not divide): :func:`commlab.tensor.resolve`, before any process."""
    from commlab.models import build_workload
    from commlab.tensor import resolve

    probe = build_workload(name, **sizes).model
    for tp in sorted({lay.tp for lay in among}):
        resolve(probe, plan, tp)


def micro_batch(batch: int, dp: int, microbatches: int) -> int | None:
    """Each micro-batch's size on a replica, or None where the batch does not split evenly."""
    if batch % (dp * microbatches):
        return None
    return batch // (dp * microbatches)


def split_profiles(name: str, sizes: Mapping, plan: Mapping[str, str], world: int, batch: int, microbatches: Sequence[int],
                   checkpoints: Sequence[str], heads: int | None = None, repeat: int = 7) -> dict[tuple, SplitProfile]:  # fmt: skip
    """Per (tp, dp, m, checkpoint) of the layouts without a pipeline, the one-rank profile of rank 0's share."""
    import torch

    from commlab.costmodel.planner.split import profile_split
    from commlab.models import build_workload
    from commlab.runtime.threads import rank_threads

    import torch.distributed as dist

    from commlab.costmodel.planner.split import ddp_sync_seconds

    # each rank's own one-rank group, for DDP's share of a data-parallel layout (every rank makes every group)
    solo = [dist.new_group([r]) for r in range(dist.get_world_size())] if dist.is_initialized() else None
    out = {}
    with rank_threads(world):
        for lay in layouts(world, heads):
            if lay.pp > 1:
                continue
            for m in microbatches:
                size = micro_batch(batch, lay.dp, m)
                for mode in checkpoints:
                    if size is None or mode not in RECOMPUTE:
                        continue
                    torch.manual_seed(0)
                    workload = build_workload(name, **sizes)
                    x, y = workload.make_batch(size, torch.Generator().manual_seed(0))
                    profile = profile_split(workload.model, plan, lay.tp, x, y, workload.loss_fn,
                                            recompute=RECOMPUTE[mode], repeat=repeat)  # fmt: skip
                    if lay.dp > 1 and solo is not None:
                        sync = ddp_sync_seconds(workload.model, x, y, workload.loss_fn, solo[dist.get_rank()], repeat)
                        profile = replace(profile, sync_s=sync)
                    out[(lay.tp, lay.dp, m, mode)] = profile
    return out


def _profile_rank(args: dict[str, Any], _common: Any) -> dict:
    return split_profiles(**args)


def co_profiles(ranks: int, timeout: float = 600.0, **args) -> dict:
    """:func:`split_profiles` on ``ranks`` ranks at once (tp_calibrate.py says why):
    per key, rank 0's profile with each layer's times the median over ranks."""

    from commlab.costmodel.calibration.run import run_calibration

    run = run_calibration(_profile_rank, args, None, world_size=ranks, backend="gloo", timeout=timeout, spread=lambda _r: 0.0)
    per_rank = run.results
    out = {}
    for key, first in per_rank[0].items():
        med = [statistics.median(r[key].forward[l] for r in per_rank) for l in range(len(first.forward))]
        back = [statistics.median(r[key].backward[l] for r in per_rank) for l in range(len(first.backward))]
        out[key] = replace(first, forward=tuple(med), backward=tuple(back),
                           saved_bytes=max(r[key].saved_bytes for r in per_rank),
                           sync_s=statistics.median(r[key].sync_s for r in per_rank))  # fmt: skip
    return out


def accumulate_plans(profiles: Mapping[tuple, SplitProfile], world: int, system: SystemCosts,
                     optimizer: str = "none") -> list[LayoutPlan]:  # fmt: skip
    """:func:`split_profiles`' layouts priced on the core."""
    out = []
    for (tp, dp, m, mode), profile in profiles.items():
        parallel = DataParallel(dp) if dp > 1 else None
        out.append(LayoutPlan(Layout(tp, world // (tp * dp), dp), ACCUMULATE, m, mode, step_time(profile, m, system, parallel),
                              peak_bytes(profile, dp, optimizer)))  # fmt: skip
    return out


def pipeline_plans(name: str, sizes: Mapping, batch: int, microbatches: Sequence[int], ranks: int, schedules: Sequence[str],
                   checkpoints: Sequence[str], echo: Callable[[str], None], optimizer: str = "none") -> tuple[list[LayoutPlan], list[str], SystemCosts]:  # fmt: skip
    """The pipeline layout tp 1 x pp ``ranks`` x dp 1, as ``commlab pipeline plan --model`` plans
    it: the model profiled by pieces, its stages timed every rank at once and each schedule run
    off the grid in one calibration launch (:func:`commlab.costmodel.planner.calibrate.plan_costs`),
    then :func:`commlab.costmodel.planner.plan.candidates`. Returns the plans, the split points
    and the calibrated costs."""
    from commlab.costmodel.planner.calibrate import plan_costs
    from commlab.costmodel.planner.model import profile_model
    from commlab.costmodel.planner.offgrid import calibration_count, calibration_runs
    from commlab.costmodel.planner.plan import candidates
    from commlab.costmodel.planner.stages import needs_split, stage_ranges

    ms = [m for m in microbatches if m >= ranks and batch % m == 0]
    families = [(n, 1) for n in schedules]
    count = calibration_count(families, ranks, ms, batch)
    profiles, points = profile_model(name, batch, ms + ([count] if count else []), ranks, **sizes)
    model = {"model": name, "sizes": dict(sizes), "points": points}
    stages = {"model": model, "batch": batch, "split": needs_split(schedules),
              "ranges": {m: sorted(stage_ranges(p.seconds, ranks, [1], schedules)) for m, p in profiles.items()}}
    offgrid = calibration_runs(profiles[count], count, ranks, families, "time", model, batch) if count else None
    system, overheads, profiles = plan_costs(profiles, ranks, 1, echo=echo, stages=stages, offgrid=offgrid)
    profiles.pop(count, None)
    lay = Layout(1, ranks, 1)
    plans = [LayoutPlan(lay, p.schedule, p.microbatches, p.checkpoint, p.step_time, max(p.peak_bytes), p.balance)
             for p in candidates(profiles, ranks, [1], checkpoints, schedules, system, os.cpu_count(), None,
                                 optimizer=optimizer, overheads=overheads)]  # fmt: skip
    return plans, points, system


def best(plans: Sequence[LayoutPlan], budget: float) -> LayoutPlan | None:
    """The fastest plan whose predicted peak per rank fits ``budget`` bytes."""
    fitting = [p for p in plans if p.peak_bytes <= budget]
    return min(fitting, key=lambda p: p.step_time) if fitting else None


def table(plans: Sequence[LayoutPlan], budget: float) -> list[str]:
    lines = [f"{'layout':<14} {'schedule':<11} {'m':>3} {'checkpoint':<10} {'pred ms':>8} {'peak MiB/rank':>14}"]
    for p in sorted(plans, key=lambda p: p.step_time):
        mark = "" if p.peak_bytes <= budget else "  over budget"
        lines.append(f"{str(p.layout):<14} {p.schedule:<11} {p.microbatches:>3} {p.checkpoint:<10} {p.step_time * 1e3:8.2f} "
                     f"{p.peak_bytes / 2**20:14.2f}{mark}")  # fmt: skip
    return lines


def costs(profiles: Mapping[tuple, SplitProfile], echo: Callable[[str], None], system: SystemCosts = SystemCosts()) -> SystemCosts:
    """``system`` with, per group size, the all-reduce tables the accumulating layouts need: DDP's
    (from a barrier, at bucket sizes) and the tensor-parallel one (between compute, at the sizes
    the operators issue)."""

    from commlab.costmodel.calibration.driver import table_sizes
    from commlab.costmodel.planner.calibrate import allreduce_table
    from commlab.costmodel.planner.layouts import BETWEEN
    from commlab.costmodel.planner.tp_calibrate import between_compute_table, median_gap

    tables = {}
    total = max(p.param_bytes for p in profiles.values())
    for group in sorted({dp for _, dp, _, _ in profiles if dp > 1}):
        cost, steadiness = allreduce_table(group, table_sizes(total))
        tables[("allreduce", "native", group)] = cost
        echo(f"DDP's all-reduce on {group} Gloo ranks: {len(cost.sizes)} sizes; {steadiness.describe()}")
    for group in sorted({tp for tp, _, _, _ in profiles if tp > 1}):
        share = {k: p for k, p in profiles.items() if k[0] == group}
        sizes = {b for p in share.values() for passes in (p.forward_collectives, p.backward_collectives)
                 for layer in passes for _, b in layer}  # fmt: skip
        gap = median_gap(share)
        tables[("allreduce", BETWEEN, group)] = cost = between_compute_table(group, sorted(sizes | {4}), gap)
        echo(f"tensor-parallel all-reduce on {group} Gloo ranks between {gap * 1e3:.2f} ms of compute: "
             + ", ".join(f"{s} B {cost(s) * 1e3:.2f} ms" for s in sorted(sizes)))
    return replace(system, collectives={**system.collectives, **tables})
