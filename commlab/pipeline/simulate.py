"""Dry-run simulation of a schedule: when each action runs, step time, idle time and the bubble.

Each rank runs its actions strictly in order; an action starts when its rank is free and its
inputs exist (:func:`dependencies`). :func:`simulate` lowers the schedule onto the shared
discrete-event core (:mod:`commlab.sim`, via :func:`commlab.pipeline.predict.lower`) with sends
that never block, the schedule's own cost; a schedule deadlocks exactly when no rank can start
its next action, which :func:`walk` finds without a time model (the validator's check).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from commlab.sim import DeadlockError as CoreDeadlockError
from commlab.pipeline.actions import BACKWARD, FORWARD, INPUT_GRAD, WEIGHT_GRAD, Action, Actions, num_stages


class DeadlockError(CoreDeadlockError):
    """The schedule cannot finish: every unfinished rank waits for an action that never runs."""


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

    @property
    def bubble(self) -> float:
        """Idle share of all ranks' time: sum(idle) / (ranks * step_time)."""
        return sum(self.idle) / (len(self.idle) * self.step_time) if self.step_time else 0.0


def split_stages(actions: Actions) -> frozenset[int]:
    """Stages whose backward is split into I and W (their input gradient comes from I, not B)."""
    return frozenset(a.stage for rank in actions for a in rank if a.kind == INPUT_GRAD)


def dependencies(action: Action, stages: int, split: frozenset[int] = frozenset()) -> tuple[Action, ...]:
    """The actions whose results ``action`` consumes (``split``: stages that run I/W, not B).

    F(s, i) needs F(s-1, i); B(s, i) and I(s, i) need F(s, i) and the input gradient of stage s+1
    (its B or its I); W(s, i) needs I(s, i), which leaves the weights' gradients to compute.
    """
    s, i = action.stage, action.microbatch
    if action.kind == FORWARD:
        return (Action(s - 1, FORWARD, i),) if s > 0 else ()
    if action.kind == WEIGHT_GRAD:
        return (Action(s, INPUT_GRAD, i),)
    later = (Action(s + 1, INPUT_GRAD if s + 1 in split else BACKWARD, i),) if s + 1 < stages else ()
    return (Action(s, FORWARD, i), *later)


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
    block; :func:`commlab.pipeline.predict.predict` adds what the executor really does.
    """
    from commlab.pipeline.predict import Costs, lower
    from commlab.sim import simulate as run_tasks

    stages = num_stages(actions)
    costs = Costs(_per_stage(forward, stages, "forward"), _per_stage(backward, stages, "backward"), weight_share,
                  alpha=comm, durations=dict(durations or {}))  # fmt: skip
    try:
        result = run_tasks(lower(actions, costs, posting=False, waits=False, contention=False, after=after))
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
    )


def walk(actions: Actions, after: Mapping[Action, Sequence[Action]] | None = None) -> list[tuple[int, Action]]:
    """The actions in an order that respects every dependency (no time model); DeadlockError if none exists.

    Each rank runs its list in order; an action can run once its dependencies (and ``after``) ran.
    The validator's deadlock check and the send-wait analysis need only this order.
    """
    ranks, stages, split = len(actions), num_stages(actions), split_stages(actions)
    after = after or {}
    done: set[Action] = set()
    nxt = [0] * ranks
    order: list[tuple[int, Action]] = []
    remaining = sum(len(a) for a in actions)
    while remaining:
        ran = []
        for r in range(ranks):
            if nxt[r] < len(actions[r]):
                act = actions[r][nxt[r]]
                if all(d in done for d in (*dependencies(act, stages, split), *after.get(act, ()))):
                    ran.append((r, act))
        if not ran:
            waiting = {r: str(actions[r][nxt[r]]) for r in range(ranks) if nxt[r] < len(actions[r])}
            raise DeadlockError(f"schedule deadlocks: ranks wait forever at {waiting}")
        for r, act in ran:  # one step of every ready rank: a unit-time clock, as the grid shows
            done.add(act)
            nxt[r] += 1
            order.append((r, act))
            remaining -= 1
    return order


def peak_in_flight(actions: Actions) -> tuple[int, ...]:
    """Per stage, the most micro-batches whose forward ran and whose backward has not.

    This bounds the activations a stage stashes: m for GPipe, p - s for 1F1B (Narayanan et al.
    2021, section 2.2).
    """
    stages = num_stages(actions)
    live = [0] * stages
    peak = [0] * stages
    for rank in actions:
        for a in rank:
            # A split backward frees the stage's activations only at W, which still needs them.
            live[a.stage] += 1 if a.kind == FORWARD else (-1 if a.kind in (BACKWARD, WEIGHT_GRAD) else 0)
            peak[a.stage] = max(peak[a.stage], live[a.stage])
    return tuple(peak)


def bubble_formula(ranks: int, microbatches: int, virtual: int = 1) -> float:
    """The bubble fraction for uniform stages: (p-1) / (v*m + p-1).

    For GPipe and 1F1B (v = 1) this is Huang et al.'s (p-1)/(m+p-1). Interleaving divides the
    bubble time by v (Narayanan et al. SC'21, eq. in section 2.2: (p-1)/(v*m) of the ideal time).
    """
    return (ranks - 1) / (virtual * microbatches + ranks - 1)
