"""The schedule's own clock: when each action runs if every kind takes its ticks and messages are free.

Each rank runs its list in order; an action starts at the first tick at which its rank is free
and every action it depends on (:func:`commlab.pipeline.schedule.kinds.dependencies`, plus
``after``) has ended. This is the lockstep walk torch.distributed.pipelining's ``_add_send_recv``
makes over its ranks, with an integer length per kind (``Kind.ticks``: F, I and W one, B two, the
usual backward = 2 x forward). It needs no time model, so the deadlock check (:func:`walk`) and
the comm pass's send waits (:mod:`commlab.pipeline.schedule.comm`) read it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from commlab.pipeline.schedule.actions import Action, Actions, flatten, num_stages
from commlab.pipeline.schedule.kinds import KINDS, dependencies, split_stages
from commlab.sim import DeadlockError as CoreDeadlockError


class DeadlockError(CoreDeadlockError):
    """The schedule cannot finish: every unfinished rank waits for an action that never runs."""


def clock(actions: Actions, ticks: Mapping[str, int] | None = None,
          after: Mapping[Action, Sequence[Action]] | None = None) -> dict[Action, tuple[int, int]]:  # fmt: skip
    """(start, end) tick of every action; ``ticks`` overrides a kind's length. DeadlockError if
    some rank waits forever."""
    actions = flatten(actions)  # an overlap's parts run in order, each on its own ticks
    length = {k: kind.ticks for k, kind in KINDS.items()} | dict(ticks or {})
    ranks, stages, split = len(actions), num_stages(actions), split_stages(actions)
    after = after or {}
    span: dict[Action, tuple[int, int]] = {}
    nxt, free = [0] * ranks, [0] * ranks
    remaining, t = sum(len(a) for a in actions), 0
    while remaining:
        started = False
        for r in range(ranks):
            if nxt[r] == len(actions[r]) or free[r] > t:
                continue
            a = actions[r][nxt[r]]
            needs = (*dependencies(a, stages, split), *after.get(a, ()))
            if all(d in span and span[d][1] <= t for d in needs):
                span[a] = (t, t + length[a.kind])
                free[r], nxt[r], remaining, started = span[a][1], nxt[r] + 1, remaining - 1, True
        if not started and all(f <= t for f in free) and remaining:
            waiting = {r: str(actions[r][nxt[r]]) for r in range(ranks) if nxt[r] < len(actions[r])}
            raise DeadlockError(f"schedule deadlocks: ranks wait forever at {waiting}")
        t += 1
    return span


def walk(actions: Actions, after: Mapping[Action, Sequence[Action]] | None = None) -> list[tuple[int, Action]]:
    """The actions in an order that respects every dependency (unit ticks); DeadlockError if none exists."""
    actions = flatten(actions)
    span = clock(actions, dict.fromkeys(KINDS, 1), after)
    rank_of = {a: r for r, rank in enumerate(actions) for a in rank}
    return sorted(((rank_of[a], a) for a in span), key=lambda ra: (span[ra[1]][0], ra[0]))
