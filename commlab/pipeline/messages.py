"""The messages a schedule sends: who sends what to whom, in which order, and when a send may be awaited.

A forward of stage s sends its activation to the rank of stage s+1; a backward (B or I) of stage
s sends its input gradient to the rank of stage s-1; W sends nothing; neighbours on the same rank
hand over without a message. Two properties of the executor's communication follow from the
action lists alone, so they are pure functions tested without processes:

- :func:`message_order`: NCCL matches point-to-point operations between two ranks by issue
  order, not by tag, so the receiver must consume a pair's messages in the order they were sent.
- :func:`send_waits`: a Gloo send completes only at ``wait()`` and keeps its tensor alive until
  then, and it can complete only once the peer has posted the receive. The executor posts the
  receive for an action right after the action before it, so waiting on a send too early stalls
  the sender (or, if the peer's posting depends on the sender's later work, deadlocks). We wait
  before the first action that, in the schedule's own timeline, starts after the receive was
  posted: the sent tensor is released early and the wait costs nothing there (torch's
  Schedule1F1B waits on the previous send for the same reason).
- :func:`receive_posts`: when each receive is posted. On Gloo a receive is posted as early as
  one outstanding receive allows, so that is no later than the above assumes and the waits stay
  free (and safe: a send can only complete earlier).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from functools import lru_cache
from types import MappingProxyType

from commlab.pipeline.actions import BACKWARD, FORWARD, INPUT_GRAD, Action, Actions, num_stages, placement_of


def consumer(action: Action, stages: int, split: frozenset[int]) -> Action | None:
    """The action that consumes what ``action`` sends, or None if it sends nothing."""
    s, i = action.stage, action.microbatch
    if action.kind == FORWARD and s + 1 < stages:
        return Action(s + 1, FORWARD, i)
    if action.kind in (BACKWARD, INPUT_GRAD) and s > 0:
        return Action(s - 1, INPUT_GRAD if s - 1 in split else BACKWARD, i)
    return None


def producer(action: Action, stages: int, split: frozenset[int]) -> Action | None:
    """The action whose message ``action`` consumes (the inverse of :func:`consumer`), or None if
    it needs none: F takes stage s-1's activation, B or I stage s+1's input gradient (its I if
    stage s+1's backward is split), W nothing."""
    s, i = action.stage, action.microbatch
    if action.kind == FORWARD and s > 0:
        return Action(s - 1, FORWARD, i)
    if action.kind in (BACKWARD, INPUT_GRAD) and s + 1 < stages:
        return Action(s + 1, INPUT_GRAD if s + 1 in split else BACKWARD, i)
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


def send_waits(actions: Actions, placement: Sequence[int] | None = None, forward: float = 1.0,
               backward: float = 2.0) -> Mapping[Action, tuple[Action, ...]]:  # fmt: skip
    """For each action, the earlier actions of its rank whose sends are awaited just before it.

    A send is awaited before the first later action of its rank that starts, in the schedule's
    simulation with these per-action costs, after the peer has posted the receive: the wait then
    costs nothing in that timeline, and since every wait agrees with one complete timeline the
    waits can never close a cycle (no deadlock, whatever the real timings). Sends with no such
    action are awaited at the end of the step.
    """
    # Cached (read-only result): the planner prices every schedule under several checkpoint modes
    # and each pricing lowers the same list, and this runs a whole simulation.
    actions = tuple(tuple(rank) for rank in actions)
    return _send_waits(actions, None if placement is None else tuple(placement), forward, backward)


@lru_cache(maxsize=128)
def _send_waits(actions: Actions, placement: tuple[int, ...] | None, forward: float, backward: float) -> Mapping[Action, tuple[Action, ...]]:
    from commlab.pipeline.simulate import simulate

    sim = simulate(actions, forward, backward)
    start = {t.action: t.start for t in sim.timeline}
    end = {t.action: t.end for t in sim.timeline}
    position = {a: k for rank in actions for k, a in enumerate(rank)}
    waits: dict[Action, list[Action]] = {}
    for src, a, dst, c in messages(actions, placement):
        k = position[c]
        posted = end[actions[dst][k - 1]] if k else 0.0  # the receive is posted when this ends
        later = actions[src][position[a] + 1 :]
        found = next((b for b in later if start[b] >= posted - 1e-9), None)
        if found is not None:
            waits.setdefault(found, []).append(a)
    return MappingProxyType({b: tuple(ws) for b, ws in waits.items()})


def receive_posts(receiving: Sequence[bool], lookahead: bool) -> dict[int, int]:
    """When one rank posts its receives: ``{j: k}`` means right after action j (-1: at the start
    of the step) the receive for action k is posted. ``receiving[k]``: action k takes a message
    from another rank. One receive is outstanding at a time (one receive buffer per rank).

    Without ``lookahead`` (NCCL) the receive for action k goes out with the sends of action k-1,
    for every k, in one group call: NCCL runs a rank's point-to-point calls in issue order on one
    stream, so a receive issued earlier would hold up the sends behind it (torch's schedules pair
    them the same way). With ``lookahead`` (Gloo, which matches by tag) it is posted right after
    the previous receiving action, not after the action just before k: a Gloo send is written
    only once its receive is posted, so with W's and same-rank hand-overs in between (zb-v) a
    late receive left the message waiting (measurements: docs/design.md, "Receive posting").
    """
    if not lookahead:
        return {k - 1: k for k in range(len(receiving))}
    posts, last = {}, -1
    for k, takes in enumerate(receiving):
        if takes:
            posts[last], last = k, k
    return posts
