"""Calibration from measured timelines: per-stage compute, message delay, executor overhead.

The step time the shared core predicts from them is :func:`predicted_step`.

A timeline is one step's actions per rank as (stage, kind, micro-batch, start, end) in
``perf_counter`` seconds (one clock for all local ranks). The benchmark calibrates the predictor
on steps run before the ones it is checked against (``calibration`` in the benchmark's results),
so a prediction is never fitted to the very measurement it is compared with. How a timed step
is taken, the same for the benchmark, the planner's calibration and its validation: each from a
barrier (:func:`from_barrier`), after one of its own where runs take turns (:func:`settle`), and
read as a timeline (:func:`step_timeline`).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

from commlab.costmodel.terms.costs import Overheads, PointToPoint, StageProfile, SystemCosts
from commlab.costmodel.lowering.pipeline import predict, shared
from commlab.pipeline.schedule.actions import Action
from commlab.pipeline.schedule.kinds import dependencies
from commlab.pipeline.schedule.registry import REGISTRY


def step_timeline(pipe) -> list[tuple]:
    """The last step of ``pipe`` (a :class:`~commlab.pipeline.runtime.executor.PipelineExecutor`)
    as a timeline: (stage, kind, micro-batch, start, end) per action, in ``perf_counter`` seconds."""
    at = pipe.started_at
    return [(t.action.stage, t.action.kind, t.action.microbatch, at + t.start, at + t.end) for t in pipe.timeline]


def step_of(stage, pipe, x, y) -> Callable[[], Any]:
    """One step of ``pipe`` on ``stage``: the mini-batch ``x`` into the first stage, the target
    ``y`` into the last."""
    return lambda: pipe.step(x if stage.is_first else None, target=y if stage.is_last else None)


def from_barrier(model) -> None:
    """Ahead of a timed step of ``model``'s stages: its gradients kept (zeroed, not freed), then a
    barrier, so that every rank starts the step together."""
    import torch.distributed as dist

    model.zero_grad(set_to_none=False)
    dist.barrier()


def settle(model, step: Callable[[], Any]) -> None:
    """Ahead of a timed ``step``: one untimed step of its own (a training job steps one pipeline
    over and over, so the timed one finds its own memory in cache, not another run's), then
    :func:`from_barrier`."""
    from_barrier(model)
    step()
    from_barrier(model)


def aligned(per_rank: list[dict[str, Any]], k: int) -> dict[int, list[tuple]]:
    """Iteration k's timeline per rank, in seconds from the earliest rank's start of the step."""
    origin = min(r["origins"][k] for r in per_rank)
    return {r["rank"]: [(s, kind, i, a - origin, b - origin) for s, kind, i, a, b in r["timelines"][k]] for r in per_rank}


def comm_latency(per_rank: list[dict[str, Any]], stages: int) -> float:
    """Median delay from a message's producer finishing to its consumer starting, counted only
    where the consumer sat idle waiting for it: the simulator's per-message ``comm``."""
    delays = []
    for k in range(len(per_rank[0]["timelines"])):
        timeline = aligned(per_rank, k)
        where = {(s, kind, i): (r, b) for r, acts in timeline.items() for s, kind, i, _, b in acts}
        split = frozenset(s for s, kind, _ in where if kind == "I")
        for r, acts in timeline.items():
            free = 0.0
            for s, kind, i, a, b in acts:
                for d in dependencies(Action(s, kind, i), stages, split):
                    rank, done = where[(d.stage, d.kind, d.microbatch)]
                    if rank != r and done > free:
                        delays.append(max(0.0, a - done))
                free = b
    return statistics.median(delays) if delays else 0.0


def idle_breakdown(timeline: dict[int, list[tuple]], stages: int, step_time: float, cores: int | None = None) -> tuple[float, float]:
    """Split one step's idle time (all ranks) into waiting for a peer's message and being idle
    although the message had arrived (executor overhead, or the OS running something else).

    Time after a rank's last action counts as waiting: it is the schedule's cool-down. With
    ``cores`` (fewer than ranks), a ready gap counts as the work the rank could do in it at the
    predictor's shared rate (:func:`_work`): the OS giving the cores to others is not overhead.
    """
    spans = [(a, b) for acts in timeline.values() for *_, a, b in acts]
    ends = {(s, kind, i): (r, b) for r, acts in timeline.items() for s, kind, i, _, b in acts}
    split = frozenset(s for s, kind, _ in ends if kind == "I")
    waiting = ready = 0.0
    for r, acts in timeline.items():
        free = 0.0
        for s, kind, i, start, end in sorted(acts, key=lambda a: a[3]):
            arrived = max([free] + [ends[(d.stage, d.kind, d.microbatch)][1] for d in dependencies(Action(s, kind, i), stages, split)
                                    if ends[(d.stage, d.kind, d.microbatch)][0] != r])  # fmt: skip
            waiting += max(0.0, min(arrived, start) - free)
            lo = max(arrived, free)
            if start > lo:
                ready += _work(lo, start, spans, cores, extra=1) if cores else start - lo
            free = end
        waiting += max(0.0, step_time - free)
    return waiting, ready


def executor_overhead(per_rank: list[dict[str, Any]], stages: int, cores: int | None = None) -> float:
    """The executor's own time per action: the median over steps of the time ranks sat idle with
    their input already there (:func:`idle_breakdown`), divided over the step's actions."""
    overheads = []
    for k in range(len(per_rank[0]["timelines"])):
        _, ready = idle_breakdown(aligned(per_rank, k), stages, 0.0, cores)
        overheads.append(ready / max(1, sum(len(r["timelines"][k]) for r in per_rank)))
    return statistics.median(overheads) if overheads else 0.0


def nominal(per_rank: list[dict[str, Any]], cores: int) -> list[dict[str, Any]]:
    """``per_rank`` with each action's interval shortened to its work at full speed: the inverse of
    the predictor's host sharing (:func:`commlab.costmodel.lowering.pipeline.sharing`). While n actions of
    any rank ran at once, each advanced at min(1, cores / n), so its work is that rate's integral."""
    out = [{**r, "timelines": []} for r in per_rank]
    for k in range(len(per_rank[0]["timelines"])):
        spans = [(a, b) for r in per_rank for *_, a, b in r["timelines"][k]]
        for r, o in zip(per_rank, out):
            timeline = []
            for s, kind, i, a, b in r["timelines"][k]:
                timeline.append((s, kind, i, a, a + _work(a, b, spans, cores)))  # this action is in spans
            o["timelines"].append(timeline)
    return out


def _work(lo: float, hi: float, spans: list[tuple[float, float]], cores: int, extra: int = 0) -> float:
    """Seconds of full-speed work in [lo, hi] for a task sharing ``cores`` with the ``spans``
    running then (plus ``extra`` not among them): the integral of min(1, cores / n)."""
    cuts = sorted({lo, hi, *(x for span in spans for x in span if lo < x < hi)})
    work = 0.0
    for a, b in zip(cuts, cuts[1:]):
        running = extra + sum(1 for c, d in spans if c < b and d > a)
        work += (b - a) * min(1.0, cores / max(1, running))
    return work


def calibrated_costs(per_rank: list[dict[str, Any]], stages: int, cores: int | None = None) -> tuple[SystemCosts, StageProfile]:
    """The predictor's costs (:class:`SystemCosts`, :class:`StageProfile`) from the calibration steps' timelines.

    Per-action compute: each stage's median measured F, B (or I and W; a checkpointed B already
    includes its recomputation); per message: the median measured producer-to-consumer delay
    (the point-to-point ``alpha``: the message cost at this run's one boundary size, so no
    ``beta`` term); per action: :func:`executor_overhead`. The planner fills the same fields from
    a profile and a plan-time micro-benchmark (:mod:`commlab.costmodel.planner.calibrate`). With more ranks than
    ``cores``, compute is the work at full speed (:func:`nominal`): the predictor slows it again.
    """
    compute = nominal(per_rank, cores) if shared(len(per_rank), cores) else per_rank
    fwd, bwd = stage_times(compute)
    shares = []
    for r in compute:
        for timeline in r["timelines"]:
            i = sum(b - a for _, kind, _, a, b in timeline if kind == "I")
            w = sum(b - a for _, kind, _, a, b in timeline if kind == "W")
            if i + w > 0:
                shares.append(w / (i + w))
    overhead = executor_overhead(per_rank, stages, cores if shared(len(per_rank), cores) else None)
    system = SystemCosts(p2p=PointToPoint(comm_latency(per_rank, stages)), overheads=Overheads(action_s=overhead))
    return system, StageProfile(tuple(fwd), tuple(bwd), statistics.median(shares) if shares else 0.5)


def predicted_step(cfg: dict[str, Any], per_rank: list[dict[str, Any]], actions, world: int, stages: int, cores: int | None = None,
                   lookahead: bool = True) -> float:  # fmt: skip
    """The step time the shared core predicts from the calibration steps' timelines in ``per_rank``
    (:func:`calibrated_costs`); the executor's receive posting (``lookahead``: Gloo's, False on
    NCCL) and send waits are modelled by :func:`commlab.costmodel.lowering.pipeline.lower`, as for the planner."""
    placement = REGISTRY[cfg["schedule"]].placement(world, stages)
    return predict(actions, *calibrated_costs(per_rank, stages, cores), placement, cores=cores, lookahead=lookahead).step_time


def stage_times(per_rank: list[dict[str, Any]]) -> tuple[list[float], list[float]]:
    """Median measured forward and backward compute time of each stage (seconds)."""
    durations: dict[tuple[int, str], list[float]] = {}
    for r in per_rank:
        for timeline in r["timelines"]:
            for stage, kind, _, start, end in timeline:
                durations.setdefault((stage, kind), []).append(end - start)
    stages = 1 + max(s for s, _ in durations)

    def backward(s: int) -> float:  # a split backward's B is its I plus its W
        if (s, "B") in durations:
            return statistics.median(durations[(s, "B")])
        return statistics.median(durations[(s, "I")]) + statistics.median(durations[(s, "W")])

    return [statistics.median(durations[(s, "F")]) for s in range(stages)], [backward(s) for s in range(stages)]
