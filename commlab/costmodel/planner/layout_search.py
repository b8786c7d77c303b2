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
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

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
                    out[(lay.tp, lay.dp, m, mode)] = profile_split(workload.model, plan, lay.tp, x, y, workload.loss_fn,
                                                                   recompute=RECOMPUTE[mode], repeat=repeat)  # fmt: skip
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


def pipeline_plans(profiles: Mapping, world: int, system: SystemCosts, checkpoints: Sequence[str], schedules: Sequence[str],
                   optimizer: str = "none") -> list[LayoutPlan]:  # fmt: skip
    """The pipeline layouts (tp 1, pp > 1): the pipeline planner's candidates on ``profiles``
    (:func:`commlab.costmodel.planner.model.profile_model`'s, per micro-batch count)."""
    from commlab.costmodel.planner.plan import candidates

    out = []
    for lay in layouts(world):
        if lay.pp < 2 or lay.tp > 1:
            continue  # a pipeline of tensor-parallel stages: not measured here yet
        parallel = DataParallel(lay.dp) if lay.dp > 1 else None
        for p in candidates(profiles, lay.pp, [1], checkpoints, schedules, system, os.cpu_count(), parallel, optimizer=optimizer):
            out.append(LayoutPlan(lay, p.schedule, p.microbatches, p.checkpoint, p.step_time, max(p.peak_bytes), p.balance))
    return out


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


def costs(profiles: Mapping[tuple, SplitProfile], pipeline_profiles: Mapping, world: int, echo: Callable[[str], None]) -> SystemCosts:
    """One calibration for the model: point-to-point and executor costs on ``world`` ranks where a
    pipeline layout is planned, and per group size the all-reduce table at the sizes the layouts
    issue (tensor-parallel activations, DDP buckets)."""
    from dataclasses import replace

    from commlab.costmodel.calibration.driver import table_sizes
    from commlab.costmodel.planner.calibrate import allreduce_table, calibrate, measured

    system = measured()
    if pipeline_profiles:
        sizes = sorted({int(b) for p in pipeline_profiles.values() for b in p.output})
        system, _, steadiness = calibrate(world, sizes)
        echo(f"point-to-point on {world} Gloo ranks: {system.p2p.alpha_s * 1e6:.0f} us + "
             f"{system.p2p.beta_s_per_byte * 1e9:.3f} ns/byte, executor {system.overheads.action_s * 1e6:.0f} us/action; "
             f"{steadiness.describe()}")  # fmt: skip
    tables = {}
    for group in sorted({g for tp, dp, _, _ in profiles for g in (tp, dp) if g > 1}):
        sizes = {b for (tp, dp, _, _), p in profiles.items() if tp == group
                 for passes in (p.forward_collectives, p.backward_collectives) for layer in passes for _, b in layer}
        total = max(p.param_bytes for p in profiles.values())
        cost, steadiness = allreduce_table(group, sorted(sizes | set(table_sizes(total))))
        tables[("allreduce", "native", group)] = cost
        echo(f"all-reduce on {group} Gloo ranks: {len(cost.sizes)} sizes; {steadiness.describe()}")
    return replace(system, collectives={**system.collectives, **tables})
