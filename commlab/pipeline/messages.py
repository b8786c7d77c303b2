"""The messages a schedule sends: who sends what to whom, in which order, and when a send may be awaited.

A forward of stage s sends its activation to the rank of stage s+1; a backward (B or I) of stage
s sends its input gradient to the rank of stage s-1; W sends nothing; neighbours on the same rank
hand over without a message. Two properties of the executor's communication follow from the
action lists alone, so they are pure functions tested without processes:

- :func:`message_order`: NCCL matches point-to-point operations between two ranks by issue
  order, not by tag, so the receiver must consume a pair's messages in the order they were sent.
- :func:`send_waits`: a Gloo send completes only at ``wait()`` and keeps its tensor alive until
  then, and it can complete only once the peer has posted the receive. The executor posts the
  receive for an action right after the action before it, so waiting on a send before action j is
  safe exactly when the peer's posting does not depend on action j or later (else: deadlock).
  We wait at the earliest such j, which releases each sent tensor as early as the schedule allows
  (torch's Schedule1F1B waits on the previous send for the same reason).
"""

from __future__ import annotations

from collections.abc import Sequence

from commlab.pipeline.actions import BACKWARD, FORWARD, INPUT_GRAD, Action, Actions, num_stages, placement_of


def consumer(action: Action, stages: int, split: frozenset[int]) -> Action | None:
    """The action that consumes what ``action`` sends, or None if it sends nothing."""
    s, i = action.stage, action.microbatch
    if action.kind == FORWARD and s + 1 < stages:
        return Action(s + 1, FORWARD, i)
    if action.kind in (BACKWARD, INPUT_GRAD) and s > 0:
        return Action(s - 1, INPUT_GRAD if s - 1 in split else BACKWARD, i)
    return None


def messages(actions: Actions, placement: Sequence[int] | None = None) -> list[tuple[int, Action, int, Action]]:
    """Every cross-rank message as (sender rank, producing action, receiver rank, consuming action)."""
    from commlab.pipeline.simulate import split_stages

    placement = placement_of(actions) if placement is None else tuple(placement)
    stages, split = num_stages(actions), split_stages(actions)
    out = []
    for r, rank in enumerate(actions):
        for a in rank:
            c = consumer(a, stages, split)
            if c is not None and placement[c.stage] != r:
                out.append((r, a, placement[c.stage], c))
    return out


def message_order(actions: Actions, placement: Sequence[int] | None = None) -> list[str]:
    """Pairs of ranks whose messages would be received in a different order than sent (one sentence each)."""
    position = {a: k for rank in actions for k, a in enumerate(rank)}
    pairs: dict[tuple[int, int], list[tuple[Action, Action]]] = {}
    for src, a, dst, c in messages(actions, placement):
        pairs.setdefault((src, dst), []).append((a, c))
    found = []
    for (src, dst), msgs in sorted(pairs.items()):
        sent = [str(a) for a, _ in sorted(msgs, key=lambda m: position[m[0]])]
        received = [str(a) for a, _ in sorted(msgs, key=lambda m: position[m[1]])]
        if sent != received:
            found.append(f"rank {src} sends {sent} but rank {dst} receives them as {received}")
    return found


def send_waits(actions: Actions, placement: Sequence[int] | None = None) -> dict[Action, tuple[Action, ...]]:
    """For each action, the earlier actions of its rank whose sends are awaited just before it.

    Sends not listed are awaited at the end of the step. See the module docstring for the rule;
    the result is checked by simulation, and an empty plan (all waits at the end) is returned
    if the waits would deadlock, which the construction should rule out.
    """
    from commlab.pipeline.simulate import DeadlockError, walk

    rank_of = {a: r for r, rank in enumerate(actions) for a in rank}
    position = {a: k for rank in actions for k, a in enumerate(rank)}
    waits: dict[Action, list[Action]] = {}
    after: dict[Action, list[Action]] = {}
    # One wait at a time, each decided on the graph that already holds the earlier ones: two waits
    # that are safe alone can still wait on each other.
    for src, a, dst, c in sorted(messages(actions, placement), key=lambda m: (position[m[1]], m[0])):
        clock = _clocks(actions, after)
        k = position[c]
        posted_after = actions[dst][k - 1] if k else None  # the receive is posted when this ends
        latest = clock[posted_after][src] if posted_after is not None else -1
        j = max(position[a] + 1, latest + 1)
        if j < len(actions[src]):
            waits.setdefault(actions[src][j], []).append(a)
            if posted_after is not None:
                after.setdefault(actions[src][j], []).append(posted_after)
    try:
        walk(actions, after)
    except DeadlockError:  # pragma: no cover - ruled out by construction; the end-of-step waits are safe
        return {}
    assert all(rank_of[b] == rank_of[w] for b, ws in waits.items() for w in ws)
    return {b: tuple(ws) for b, ws in waits.items()}


def _clocks(actions: Actions, after: dict[Action, list[Action]]) -> dict[Action, list[int]]:
    """Vector clocks: clock[a][r] is the latest position on rank r that ``a`` depends on (itself included)."""
    from commlab.pipeline.simulate import dependencies, split_stages, walk

    ranks, stages, split = len(actions), num_stages(actions), split_stages(actions)
    position = {a: k for rank in actions for k, a in enumerate(rank)}
    clock: dict[Action, list[int]] = {}
    for r, a in walk(actions, after):
        k = position[a]
        vc = list(clock[actions[r][k - 1]]) if k else [-1] * ranks
        for d in (*dependencies(a, stages, split), *after.get(a, ())):
            vc = [max(x, y) for x, y in zip(vc, clock[d])]
        vc[r] = k
        clock[a] = vc
    return clock
