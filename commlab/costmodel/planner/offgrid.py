"""The executor's overhead and compute stretch per schedule, from the model's own runs off the predicted grid.

How long the executor sits with its input there depends on the schedule's pattern of sends,
receives and waits, not only on the action (on a 10 x 640 MLP interleaved 1F1B idled 0.9 ms per
action, 1F1B 0.3 ms), and an action computes longer inside the pipeline than the profile timed it
alone, by how much depending on the model: a backward whose saved activations went cold while
other actions ran costs more (a 16 x 512 Linear stack: 1.17x on 2 Gloo ranks, a GPT 1.05x),
and with checkpointing the recomputed forward warms them again (both 1.02x). Linear+ReLU
stand-in stages sized like the model's stretched 1.14-1.32x whatever the model, so these terms
are measured on the model itself: every schedule the plans use runs a few steps on it at one
micro-batch count that no plan uses (:func:`calibration_count`: 6 for counts 2, 4, 8, 16 on 2
ranks), without and with checkpointing (:func:`run_rank`), cut as the plans cut it. Against the
profile of the same stages at that micro-batch size (taken with the rest of the profile):

- the stretch: the actions' measured seconds over the profiled ones, median over steps (below 1 too:
  the profile alternates two micro-batches, and a pipeline may run its actions warmer);
- the overhead: what the executor adds per action for the shared core to give the run's measured
  step (:func:`fit_overhead`), its compute stretched and its messages priced by the
  point-to-point line: whatever the core does not model lands here, per schedule.

No configuration the planner predicts runs before its prediction; what transfers from the
calibration count to the plans' counts is a per-action overhead and a ratio (:func:`schedule_costs`).
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

from commlab.costmodel.terms.costs import StageProfile, SystemCosts
from commlab.costmodel.lowering.pipeline import predict
from commlab.costmodel.calibration.pipeline import from_barrier, settle, step_of, step_timeline
from commlab.costmodel.planner.model import stage_builder
from commlab.pipeline.schedule.actions import FORWARD, INPUT_GRAD, Action
from commlab.pipeline.schedule.registry import REGISTRY
from commlab.runtime.timer import StartTime, timed_rounds, timed_steps

# Each schedule runs without and with checkpointing: a checkpointed micro-batch's forward runs
# without grad and its backward recomputes it, and the two stretch differently in the pipeline.
CHECKPOINTS = ("never", "always")


def calibration_count(schedules: Sequence[tuple[str, int]], ranks: int, microbatches: Sequence[int], batch: int) -> int | None:
    """The micro-batch count of the calibration runs: the smallest of at least 3 that no plan
    uses, that every (schedule, stages per rank) of ``schedules`` accepts on ``ranks`` ranks and
    that leaves a micro-batch of at least one sample; None if there is none up to ``batch``."""
    for m in range(3, batch + 1):
        if m not in microbatches and all(_accepts(REGISTRY[n], ranks, m, v) for n, v in schedules):
            return m
    return None


def _accepts(spec, ranks: int, m: int, v: int) -> bool:
    try:
        spec.check(ranks, m, v)
    except ValueError:
        return False
    return True


def run_rank(common: dict[str, Any]) -> dict[tuple[str, int], dict[str, dict]]:
    """On every rank of the calibration launch: each (schedule, balance) of ``common["offgrid"]["runs"]``
    on the model ``common["offgrid"]`` describes (as :func:`commlab.validation.planner.measure_rank`
    takes it) at its ``microbatches``, with each mode of :data:`CHECKPOINTS`, keyed by (schedule,
    stages per rank) and mode: each timed step's timeline and start (:func:`step_timeline`). The runs
    take turns, ``common["steps"]`` rounds in alternating order, each visit one step after one of
    its own, as ``pipeline plan --validate`` measures the plans: a burst of load on a shared host
    hits every schedule's calibration alike."""
    from commlab.pipeline.runtime.executor import PipelineExecutor

    import commlab

    rt = commlab.Runtime.current()
    spec = common["offgrid"]
    m = spec["microbatches"]
    x, y, loss_fn, build = stage_builder({**spec, "batch": m * (spec["batch"] // m)})
    runs, steps = [], []
    for name, balance in spec["runs"]:
        model, stage = build({"balance": balance, "microbatches": m}, REGISTRY[name].placement(rt.world_size, len(balance)))
        for mode in CHECKPOINTS:
            pipe = PipelineExecutor(stage, name, microbatches=m, loss_fn=loss_fn, track_memory=False, timeout=common["timeout"],
                                    checkpoint=mode)  # fmt: skip
            runs.append(((name, len(balance) // rt.world_size), mode, model, pipe))
            steps.append(step_of(stage, pipe, x, y))
    timelines: list[list] = [[] for _ in runs]
    origins = timed_rounds(dict(enumerate(steps)), common["steps"], meters={"origins": StartTime()},
                           before=lambda k: settle(runs[k][2], steps[k]),
                           after=lambda k, _timed: timelines[k].append(step_timeline(runs[k][3])))["origins"]
    out: dict[tuple[str, int], dict[str, dict]] = {}
    for k, (key, mode, _, _) in enumerate(runs):
        out.setdefault(key, {})[mode] = {"timelines": timelines[k], "origins": origins[k]}
    return out


def executor_timelines(model, stage, schedule: str, m: int, x, y, loss_fn, common: dict[str, Any],
                       checkpoint: str = "never") -> dict[str, list]:  # fmt: skip
    """A few steps (``common["steps"]``, after one untimed) of the real executor on ``stage``
    (a :class:`~commlab.pipeline.runtime.stages.RankStages` of ``model``), each from a barrier:
    each step's timeline and start (:func:`step_timeline`)."""
    from commlab.pipeline.runtime.executor import PipelineExecutor

    pipe = PipelineExecutor(stage, schedule, microbatches=m, loss_fn=loss_fn, track_memory=False, timeout=common["timeout"],
                            checkpoint=checkpoint)  # fmt: skip
    timelines: list[list] = []
    origins = timed_steps(step_of(stage, pipe, x, y), common["steps"], 1, clock=StartTime(), before=lambda: from_barrier(model),
                          after=lambda timed: timed and timelines.append(step_timeline(pipe)))
    return {"timelines": timelines, "origins": origins}


def schedule_costs(per_rank: list[dict[str, Any]], ranks: int, runs: Mapping[tuple[str, int], Any], m: int,
                   system: SystemCosts, cores: int | None = None) -> dict[tuple[str, int], dict[str, tuple[float, float]]]:  # fmt: skip
    """Per (schedule, stages per rank) of ``runs`` and per checkpoint mode, (overhead per action,
    compute stretch), from its runs at ``m`` micro-batches (``per_rank[r]["offgrid"]``, every
    rank's :func:`run_rank`); ``runs[key]``: the run's stages as profiled alone, a
    :class:`~commlab.costmodel.terms.costs.StageProfile` whose forward and backward are the run's
    kinds (a split backward's I + W) plus ``nograd``, the forward without grad per stage."""
    out = {}
    for key, (profile, nograd) in runs.items():
        name, virtual = key
        costs = {}
        for mode in CHECKPOINTS:
            found = [r["offgrid"][key][mode] for r in per_rank]
            again = mode != "never"  # "always" is the only other mode run: every micro-batch recomputed

            def expected(s: int, kind: str) -> float:
                f, b = profile.forward[s], profile.backward[s]
                if kind == "F":
                    return nograd[s] if again else f
                own = {"B": b, "I": b * (1 - profile.weight_share), "W": b * profile.weight_share}[kind]
                return own + (f if again and kind in ("B", "I") else 0.0)

            ratios, steps = [], []
            for k in range(len(found[0]["timelines"])):
                acts = [a for r in found for a in r["timelines"][k]]
                ratios.append(sum(b - a for *_, a, b in acts) / max(sum(expected(s, kind) for s, kind, *_ in acts), 1e-12))
                steps.append(max(b for *_, b in acts) - min(r["origins"][k] for r in found))
            stretch = statistics.median(ratios) if ratios else 1.0
            stretched = replace(profile, forward=tuple(f * stretch for f in profile.forward),
                                backward=tuple(b * stretch for b in profile.backward))  # fmt: skip
            actions = REGISTRY[name].build(ranks, m, virtual)
            recomputed = tuple(range(m)) if again else ()
            first = {Action(s, FORWARD, j): nograd[s] * stretch for s in range(len(nograd)) for j in recomputed}
            target = statistics.median(steps) if steps else 0.0
            placement = REGISTRY[name].placement(ranks, ranks * virtual)
            costs[mode] = (fit_overhead(actions, system, stretched, placement, recomputed, cores, first, target), stretch)
        out[key] = costs
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


def calibration_runs(profile: Any, count: int, ranks: int, schedules: Sequence[tuple[str, int]], balance_mode: str,
                     model: Mapping[str, Any], batch: int) -> dict:  # fmt: skip
    """What the calibration launch runs (:func:`run_rank`'s spec): ``model`` (described as
    :func:`commlab.validation.planner.measure_rank` takes it) at ``count`` micro-batches of
    ``batch``, each (schedule, stages per rank) of ``schedules`` cut as the plans cut it, by
    ``profile`` (the :class:`~commlab.costmodel.planner.plan.LayerProfile` at ``count``)."""
    from commlab.pipeline.runtime.partition import partition

    layers = len(profile.seconds)
    runs = [(name, list(partition(profile.seconds if balance_mode == "time" else [1.0] * layers, ranks * v)))
            for name, v in schedules if ranks * v <= layers]  # fmt: skip
    return {**model, "batch": batch, "microbatches": count, "runs": runs}


def profiled_runs(profile: Any, spec: Mapping[str, Any], ranks: int) -> dict[tuple[str, int], tuple]:
    """Per (schedule, stages per rank) of ``spec`` (:func:`calibration_runs`), its stages as
    ``profile`` (at the runs' count, with its stages timed whole) has them alone: what
    :func:`schedule_costs` holds the runs against, (StageProfile, forward without grad per stage)."""
    out = {}
    for name, balance in spec["runs"]:
        stages = profile.stage_profile(balance, INPUT_GRAD in REGISTRY[name].kinds)
        out[(name, len(balance) // ranks)] = (stages, profile.nograd_forward(balance) or stages.forward)
    return out
