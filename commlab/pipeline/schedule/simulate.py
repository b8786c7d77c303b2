"""Dry-run simulation of a schedule under per-stage costs: when each action runs, step time, bubble.

Each rank runs its actions strictly in order; an action starts when its rank is free and its
inputs exist (:func:`commlab.pipeline.schedule.kinds.dependencies`). :func:`simulate` puts the
comm pass's lists on the shared discrete-event core (:mod:`commlab.sim`, via
:func:`commlab.pipeline.schedule.tasks.tasks`) with sends that never block: the schedule's own
cost. A schedule deadlocks exactly when no rank can start its next action, which
:func:`commlab.pipeline.schedule.clock.walk` finds without a time model.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from commlab.pipeline.schedule.actions import Action, Actions, num_stages
from commlab.pipeline.schedule.clock import DeadlockError, walk
from commlab.pipeline.schedule.comm import Message, lower_comm
from commlab.pipeline.schedule.kinds import KINDS
from commlab.pipeline.schedule.liveness import peak_in_flight
from commlab.pipeline.schedule.tasks import tasks
from commlab.sim import DeadlockError as CoreDeadlockError
from commlab.sim import simulate as run_tasks

__all__ = ["DeadlockError", "Simulation", "Timed", "bubble_formula", "peak_in_flight", "simulate", "walk"]


@dataclass(frozen=True)
class Timed:
    rank: int
    action: Action
    start: float
    end: float


@dataclass(frozen=True)
class Simulation:
    """What a schedule costs under given per-stage times."""

    timeline: tuple[Timed, ...]  # every action, in order of start time
    step_time: float
    busy: tuple[float, ...]  # per rank
    idle: tuple[float, ...]  # per rank: step_time - busy
    peak_in_flight: tuple[int, ...]  # per stage: most micro-batches forwarded but not yet backwarded
    messages: tuple[tuple[Message, float, float], ...] = ()  # each SEND of the comm pass: (message, start, end)

    @property
    def bubble(self) -> float:
        """Idle share of all ranks' time: sum(idle) / (ranks * step_time)."""
        return sum(self.idle) / (len(self.idle) * self.step_time) if self.step_time else 0.0


def _per_stage(value: float | Sequence[float], stages: int, what: str) -> list[float]:
    if isinstance(value, (int, float)):
        values = [float(value)] * stages
    else:
        values = [float(x) for x in value]
    if len(values) != stages:
        raise ValueError(f"{what} needs one time per stage: {len(values)} given, {stages} stages")
    if any(x < 0 for x in values):
        raise ValueError(f"{what} times must be non-negative, got {values}")
    return values


def simulate(
    actions: Actions,
    forward: float | Sequence[float] = 1.0,
    backward: float | Sequence[float] = 2.0,
    comm: float = 0.0,
    durations: Mapping[Action, float] | None = None,
    *,
    weight_share: float = 0.5,
    after: Mapping[Action, Sequence[Action]] | None = None,
) -> Simulation:
    """Run the schedule on the shared core (:mod:`commlab.sim`); raise :class:`DeadlockError` if it cannot finish.

    ``forward`` and ``backward`` are per-stage times (one number for all stages, or a list);
    ``comm`` is added to every dependency that crosses ranks. The default backward = 2 x forward
    is the usual estimate (a backward computes gradients for both inputs and weights); a split
    backward gives ``weight_share`` of it to W and the rest to I. ``durations`` overrides the time
    of individual actions: replaying one measured step's own compute times shows what the schedule
    would have cost with zero executor overhead. ``after`` adds waits: an action starts only after
    the listed actions ended. This is the schedule's own cost: messages never queue and sends never
    block; :func:`commlab.costmodel.lowering.pipeline.predict` adds what the executor really does.
    """
    stages = num_stages(actions)
    fwd, bwd = _per_stage(forward, stages, "forward"), _per_stage(backward, stages, "backward")
    durations = durations or {}

    def seconds(a: Action) -> float:
        return durations[a] if a in durations else KINDS[a.kind].seconds(fwd[a.stage], bwd[a.stage], weight_share)

    lowered = lower_comm(actions)
    try:
        result = run_tasks(tasks(lowered, seconds, lambda m: comm, posting=False, waits=False, contention=False, after=after))
    except CoreDeadlockError:
        walk(actions, after)  # names the ranks and the actions they wait at
        raise
    timeline = [Timed(sp.meta["rank"], sp.meta["action"], sp.start, sp.end) for sp in result.spans.values() if "action" in sp.meta]
    timeline.sort(key=lambda t: (t.start, t.rank))
    busy = [0.0] * len(actions)
    for t in timeline:
        busy[t.rank] += t.end - t.start
    step = result.makespan
    return Simulation(
        timeline=tuple(timeline),
        step_time=step,
        busy=tuple(busy),
        idle=tuple(step - x for x in busy),
        peak_in_flight=peak_in_flight(actions),
        messages=tuple(sorted(((sp.meta["message"], sp.start, sp.end) for sp in result.spans.values() if "message" in sp.meta),
                              key=lambda m: (m[1], str(m[0])))),  # fmt: skip
    )


def bubble_formula(ranks: int, microbatches: int, virtual: int = 1) -> float:
    """The bubble fraction for uniform stages: (p-1) / (v*m + p-1).

    For GPipe and 1F1B (v = 1) this is Huang et al.'s (p-1)/(m+p-1). Interleaving divides the
    bubble time by v (Narayanan et al. SC'21, eq. in section 2.2: (p-1)/(v*m) of the ideal time).
    """
    return (ranks - 1) / (virtual * microbatches + ranks - 1)
