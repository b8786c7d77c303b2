"""The executor's overhead and compute stretch per schedule, measured on stand-in stages.

How long the executor sits with its input there depends on the schedule's pattern of sends,
receives and waits, not only on the action: on the 10 x 640 MLP interleaved 1F1B idled 0.9 ms
per action with the input there and 1F1B 0.3 ms (docs/measurements.md), and the actions' compute
took longer inside the pipeline than alone (two ranks and Gloo's threads on the host's cores).
So the planner runs every (schedule, stages per rank, micro-batch count) it prices for a few steps on *stand-in*
stages (:func:`stand_in`): blocks of Linear+ReLU that are no layer of the planned model, with the
plans' boundary bytes between them, each rank's stages first timed alone, run without and with
checkpointing. From their timelines (:func:`schedule_costs`): the stretch of the actions'
compute against the same stages alone, and the overhead per action with which the shared core
reproduces the stand-in's measured step (:func:`fit_overhead`), so that what the core does not
model is charged where it arises, per schedule. The plans' profiled stage times are multiplied by
that stretch. Nothing of the planned model runs in the pipeline before its prediction.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

from commlab.costmodel.costs import StageProfile, SystemCosts
from commlab.costmodel.pipeline import predict
from commlab.pipeline.schedule.actions import FORWARD, INPUT_GRAD, Action
from commlab.pipeline.schedule.registry import REGISTRY


STAND_IN_WIDTH = 512  # features of the stand-in layers; the boundary's bytes set their rows
# Each stand-in runs without and with checkpointing: a checkpointed micro-batch's forward runs
# without grad and its backward recomputes it, and the two stretch differently in the pipeline.
CHECKPOINTS = ("never", "always")


def stand_in(rt, name: str, virtual: int, m: int, numel: int, layers: int, common: dict[str, Any]) -> dict[str, Any]:
    """One schedule on stand-in stages of ``layers`` Linear+ReLU blocks (not the plan's model) with
    a boundary of ``numel`` elements per micro-batch: its timelines, and each of this rank's
    stages timed alone first (:func:`~commlab.costmodel.plan_stages.time_stage`, one rank at a
    time, the others waiting at a barrier), so :func:`schedule_costs` can tell how much the
    pipeline's actions stretch against the same compute alone."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from commlab.costmodel.plan_stages import time_stage
    from commlab.pipeline.schedule.actions import INPUT_GRAD

    torch.manual_seed(0)
    stages, k = rt.world_size * virtual, STAND_IN_WIDTH
    rows = max(1, numel // k)
    model = torch.nn.Sequential(*[mod for _ in range(stages * layers) for mod in (torch.nn.Linear(k, k), torch.nn.ReLU())])
    spec = REGISTRY[name]
    placement = spec.placement(rt.world_size, stages)
    x, y = torch.randn(m * rows, k), torch.randn(m * rows, k)
    alone = {}
    for r in range(rt.world_size):
        dist.barrier()
        for s in (s for s, p in enumerate(placement) if p == r == rt.rank):
            sample = torch.randn(rows, k).requires_grad_(s > 0)
            loss = (lambda out: F.mse_loss(out, y[:rows])) if s == stages - 1 else None
            alone[s] = time_stage(list(model)[2 * layers * s : 2 * layers * (s + 1)], sample, loss,
                                  split=INPUT_GRAD in spec.kinds, repeat=9).__dict__  # fmt: skip
    dist.barrier()
    runs = {mode: executor_timelines(model, [2 * layers] * stages, placement, name, m, x, y, F.mse_loss, common, mode)
            for mode in CHECKPOINTS}  # fmt: skip
    return {"runs": runs, "alone": alone}


def schedule_costs(per_rank: list[dict[str, Any]], ranks: int, schedules: Sequence[tuple], system: SystemCosts,
                   cores: int | None = None) -> dict[tuple[str, int, int], dict[str, tuple[float, float]]]:  # fmt: skip
    """Per (schedule, stages per rank, micro-batches) on its stand-in stages (:func:`stand_in`) and per checkpoint
    mode run, (overhead per action, compute stretch):

    - the stretch: the actions' measured seconds over what the same stages took alone (a
      checkpointed forward: without grad; its backward: plus the recomputed forward), median over
      steps, at least 1;
    - the overhead: what the executor adds per action for the shared core to give the stand-in's
      measured step (median over steps), its compute stretched and its messages priced by
      ``system``'s point-to-point line (:func:`fit_overhead`). Whatever the core does not model
      (waits the receive posting does not explain, the OS) lands here, per schedule.
    """
    out = {}
    for name, virtual, m, numel, _ in schedules:
        found = [(r["rank"], r["schedules"][(name, virtual, m)]) for r in per_rank]
        alone = {s: t for _, f in found for s, t in f["alone"].items()}
        split = INPUT_GRAD in REGISTRY[name].kinds
        forward = "split_forward" if split else "forward"
        costs = {}
        for mode in found[0][1]["runs"]:
            runs = [{"rank": rank, **f["runs"][mode]} for rank, f in found]
            again = mode != "never"  # "always" is the only other mode run: every micro-batch recomputed

            def expected(s: int, kind: str) -> float:
                t = alone[s]
                if kind == "F":
                    return t["nograd_forward"] if again else t[forward]
                own = {"B": t["backward"], "I": t["input_grad"], "W": t["weight_grad"]}[kind]
                return own + (t[forward] if again and kind in ("B", "I") else 0.0)

            ratios, steps = [], []
            for k in range(len(runs[0]["timelines"])):
                acts = [a for r in runs for a in r["timelines"][k]]
                ratios.append(sum(b - a for *_, a, b in acts) / max(sum(expected(s, kind) for s, kind, *_ in acts), 1e-12))
                steps.append(max(b for *_, b in acts) - min(r["origins"][k] for r in runs))
            stretch = max(1.0, statistics.median(ratios)) if ratios else 1.0
            stages = ranks * virtual
            rows = max(1, numel // STAND_IN_WIDTH)
            w = [alone[s]["weight_grad"] for s in range(stages)]
            i = [alone[s]["input_grad"] for s in range(stages)]
            profile = StageProfile(tuple(alone[s][forward] * stretch for s in range(stages)),
                                   tuple((i[s] + w[s] if split else alone[s]["backward"]) * stretch for s in range(stages)),
                                   sum(w) / max(sum(i) + sum(w), 1e-12) if split else 0.5,
                                   message_bytes=(4.0 * rows * STAND_IN_WIDTH,) * (stages - 1))  # fmt: skip
            actions = REGISTRY[name].build(ranks, m, virtual)
            recomputed = tuple(range(m)) if again else ()
            first = {Action(s, FORWARD, j): alone[s]["nograd_forward"] * stretch for s in range(stages) for j in recomputed}
            target = statistics.median(steps) if steps else 0.0
            costs[mode] = (fit_overhead(actions, system, profile, REGISTRY[name].placement(ranks, stages), recomputed, cores,
                                        first, target), stretch)  # fmt: skip
        out[(name, virtual, m)] = costs
    return out


def pooled(costs: Mapping[tuple[str, int, int], Mapping[str, tuple[float, float]]]) -> dict:
    """``costs`` (:func:`schedule_costs`) with every micro-batch count of a (schedule, stages per
    rank) given the median over the counts of its overhead and of its stretch, per checkpoint
    mode: one stand-in step of a few milliseconds is easily disturbed on a shared host (one count
    of 1F1B once came out at 2.6 ms per action against 0.1-0.5 ms for the others), and the counts'
    own differences were below that noise."""
    groups: dict[tuple[str, int], list] = {}
    for (name, v, _), by_mode in costs.items():
        groups.setdefault((name, v), []).append(by_mode)
    out = {}
    for (name, v, m), by_mode in costs.items():
        same = groups[(name, v)]
        out[(name, v, m)] = {mode: (statistics.median(c[mode][0] for c in same), statistics.median(c[mode][1] for c in same))
                             for mode in by_mode}  # fmt: skip
    return out


def fit_overhead(actions, system: SystemCosts, profile: StageProfile, placement, recomputed, cores, durations,
                 target: float) -> float:  # fmt: skip
    """The executor overhead per action (seconds, in [0, ``target``]) with which the shared core's step
    time equals ``target`` (bisection: the step time grows with it); 0 if compute and messages
    alone already take longer."""

    def step(overhead: float) -> float:
        costs = replace(system, overheads=replace(system.overheads, action_s=overhead))
        return predict(actions, costs, profile, placement, recomputed, cores, durations=durations).step_time

    lo, hi = 0.0, target  # no action's overhead exceeds the whole step
    if step(lo) >= target:
        return 0.0
    for _ in range(30):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if step(mid) < target else (lo, mid)
    return (lo + hi) / 2


def calibration_schedules(ranks: int, names: Sequence[str], virtuals: Sequence[int], boundary_bytes: Mapping[int, float],
                          layers: int = 2) -> list[tuple[str, int, int, int, int]]:  # fmt: skip
    """What :func:`calibrate` runs: every (schedule, stages per rank, micro-batch count) the plans
    use (the counts: the keys of ``boundary_bytes``; the executor's waits differ with the count,
    e.g. interleaved 1F1B's), with that count's boundary bytes per micro-batch (as float32
    elements), and stand-in stages of one Linear+ReLU block per two of the
    model's ``layers`` a stage gets (the MLP's layers are such pairs): (name, stages per rank,
    micro-batches, elements, blocks per stage)."""
    out = []
    for name in names:
        spec = REGISTRY[name]
        for v in spec.virtual or virtuals:
            for m in sorted(m for m in boundary_bytes if _accepts(spec, ranks, m, v)):
                out.append((name, v, m, max(1, int(boundary_bytes[m]) // 4), max(1, round(layers / (2 * ranks * v)))))
    return out


def _accepts(spec, ranks: int, m: int, v: int) -> bool:
    try:
        spec.check(ranks, m, v)
    except ValueError:
        return False
    return True


def executor_timelines(model, balance, placement, schedule: str, m: int, x, y, loss_fn, common: dict[str, Any],
                       checkpoint: str = "never") -> dict[str, list]:  # fmt: skip
    """A few steps of the real executor (after one untimed step): each step's timeline as the bench records it."""
    import torch.distributed as dist

    from commlab.pipeline.runtime.executor import PipelineExecutor
    from commlab.pipeline.runtime.stages import RankStages

    stage = RankStages(model, balance, placement)
    pipe = PipelineExecutor(stage, schedule, microbatches=m, loss_fn=loss_fn, track_memory=False, timeout=common["timeout"],
                            checkpoint=checkpoint)  # fmt: skip
    calibration: dict[str, list] = {"timelines": [], "origins": []}
    for k in range(1 + common.get("stand_in_steps", common["steps"])):
        dist.barrier()
        start = time.perf_counter()
        pipe.step(x if stage.is_first else None, target=y if stage.is_last else None)
        if k:
            calibration["origins"].append(start)
            calibration["timelines"].append([(t.action.stage, t.action.kind, t.action.microbatch, pipe.started_at + t.start,
                                              pipe.started_at + t.end) for t in pipe.timeline])  # fmt: skip
    return calibration
