"""The comm pass: compute actions + placement + backend -> per-rank lists with SEND, RECV and WAIT.

Like torch.distributed.pipelining's ``_add_send_recv``, :func:`lower_comm` turns the compute-only
lists into the lists the executor runs and every other reader (validator, simulators, memory
accounting, Gantt) reads. A forward of stage s sends its activation to the rank of stage s+1; a
B or I of stage s sends its input gradient to the rank of stage s-1 (the one rule:
:func:`commlab.pipeline.schedule.kinds.producer`); neighbours on the same rank hand over without a
message. Per compute action k of a rank the pass writes, in this order:

1. ``WAIT SEND m`` for the sends awaited here (below), 2. ``WAIT RECV m`` if k takes message m,
3. the action, 4. ``SEND m`` for what it produced, 5. ``RECV m'`` if a receive is posted after it.

Consecutive SEND and RECV ops are one ``batch_isend_irecv`` at run time (the pairing torch's
schedules use, so NCCL matches a send with the peer's receive posted in the same batch).

- Receive posting (:func:`receive_posts`): one receive is outstanding at a time (one buffer per
  rank). On NCCL the receive for action k goes out with the sends of action k-1: NCCL runs a
  rank's point-to-point calls in issue order on one stream, so a receive issued earlier would
  hold up the sends behind it. On Gloo (matched by tag) it is posted right after the previous
  receiving action: a Gloo send is written only once its receive is posted, so with W's and
  same-rank hand-overs in between (zb-v) a late receive left the message waiting.
- Send waits: a Gloo send completes only at ``wait()`` and keeps its tensor alive until then, and
  only once the peer has posted the receive. We wait before the first later action that, on the
  schedule's own clock (:func:`commlab.pipeline.schedule.clock.clock`), starts after the action
  the consumer follows has ended (its receive is posted by then on either backend): the tensor is
  released early and the wait costs nothing there (torch's Schedule1F1B waits on the previous send
  for the same reason). Sends with no such action are awaited at the end of the step.
- :func:`message_order`: NCCL matches point-to-point operations between two ranks by issue
  order, not by tag, so the receiver must consume a pair's messages in the order they were sent.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from types import MappingProxyType

from commlab.pipeline.schedule.actions import Action, Actions, flatten, num_stages, placement_of
from commlab.pipeline.schedule.clock import clock
from commlab.pipeline.schedule.kinds import consumer, split_stages

BACKENDS = ("gloo", "nccl")
SEND, RECV, WAIT = "SEND", "RECV", "WAIT"


@dataclass(frozen=True)
class Message:
    """One cross-rank message: ``sent_by`` on rank ``src`` produces it, ``taken_by`` on ``dst`` consumes it."""

    src: int
    sent_by: Action
    dst: int
    taken_by: Action

    def __str__(self) -> str:
        return f"{self.sent_by}>{self.taken_by}"


@dataclass(frozen=True)
class Comm:
    """A communication op in a lowered list: SEND or RECV ``message``, or WAIT on an earlier one (``of``)."""

    kind: str
    message: Message
    of: str = ""

    def __str__(self) -> str:
        return f"{self.kind} {self.of + ' ' if self.of else ''}{self.message}"


Op = Action | Comm
Lowered = tuple[tuple[Op, ...], ...]  # indexed by rank


def messages(actions: Actions, placement: Sequence[int] | None = None) -> list[tuple[int, Action, int, Action]]:
    """Every cross-rank message as (sender rank, producing action, receiver rank, consuming action)."""
    return [(m.src, m.sent_by, m.dst, m.taken_by) for m in _messages(actions, placement)]


def _messages(actions: Actions, placement: Sequence[int] | None) -> list[Message]:
    placement = placement_of(actions) if placement is None else tuple(placement)
    actions = flatten(actions)
    stages, split = num_stages(actions), split_stages(actions)
    out = []
    for r, rank in enumerate(actions):
        for a in rank:
            c = consumer(a, stages, split)
            if c is not None and placement[c.stage] != r:
                out.append(Message(r, a, placement[c.stage], c))
    return out


def receive_posts(receiving: Sequence[bool], lookahead: bool) -> dict[int, int]:
    """When one rank posts its receives: ``{j: k}`` means right after action j (-1: at the start
    of the step) the receive for action k is posted; ``receiving[k]``: action k takes a message
    from another rank. ``lookahead``: Gloo's posting, else NCCL's (module docstring)."""
    if not lookahead:
        return {k - 1: k for k in range(len(receiving)) if receiving[k]}
    posts, last = {}, -1
    for k, takes in enumerate(receiving):
        if takes:
            posts[last], last = k, k
    return posts


def lower_comm(actions: Actions, placement: Sequence[int] | None = None, backend: str = "gloo") -> Lowered:
    """The per-rank lists with explicit SEND, RECV and WAIT ops (module docstring)."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}: choose from {', '.join(BACKENDS)}")
    # An overlap (O) is lowered as its parts: its forward's sends are posted before its backward
    # runs, so the activation travels while the backward computes (torch posts them after both).
    actions = flatten(tuple(tuple(rank) for rank in actions))
    return _lower(actions, None if placement is None else tuple(placement), backend)


@lru_cache(maxsize=128)
def _lower(actions: Actions, placement: tuple[int, ...] | None, backend: str) -> Lowered:
    msgs = _messages(actions, placement)
    taking = {m.taken_by: m for m in msgs}
    sending: dict[Action, list[Message]] = {}
    for m in msgs:
        sending.setdefault(m.sent_by, []).append(m)
    span = clock(actions)
    position = {a: k for rank in actions for k, a in enumerate(rank)}
    waits: dict[Action, list[Message]] = {}  # compute action -> sends awaited just before it
    for m in msgs:
        k = position[m.taken_by]
        posted = span[actions[m.dst][k - 1]][1] if k else 0
        later = actions[m.src][position[m.sent_by] + 1 :]
        found = next((b for b in later if span[b][0] >= posted), None)
        waits.setdefault(found, []).append(m)  # None: at the end of the step
    out = []
    for rank in actions:
        posts = receive_posts([a in taking for a in rank], lookahead=backend == "gloo")
        ops: list[Op] = [Comm(RECV, taking[rank[posts[-1]]])] if -1 in posts else []
        for k, a in enumerate(rank):
            ops += [Comm(WAIT, m, SEND) for m in waits.get(a, ())]
            if a in taking:
                ops.append(Comm(WAIT, taking[a], RECV))
            ops.append(a)
            ops += [Comm(SEND, m) for m in sending.get(a, ())]
            if k in posts:
                ops.append(Comm(RECV, taking[rank[posts[k]]]))
        mine = {m for m in sending_of(ops)}
        ops += [Comm(WAIT, m, SEND) for m in waits.get(None, ()) if m in mine]
        out.append(tuple(ops))
    return tuple(out)


def sending_of(ops: Sequence[Op]) -> list[Message]:
    """The messages a lowered list sends, in order."""
    return [op.message for op in ops if isinstance(op, Comm) and op.kind == SEND]


def compute_only(lowered: Lowered) -> Actions:
    """The compute actions of lowered lists (the schedule they were lowered from)."""
    return tuple(tuple(op for op in rank if isinstance(op, Action)) for rank in lowered)


def send_waits(actions: Actions, placement: Sequence[int] | None = None) -> Mapping[Action, tuple[Action, ...]]:
    """``{b: (a, ...)}``: before compute action b the executor waits on the sends of a, ...
    (read off :func:`lower_comm`; sends awaited at the end of the step are not listed)."""
    waits: dict[Action, list[Action]] = {}
    for rank in lower_comm(actions, placement):
        pending: list[Action] = []
        for op in rank:
            if isinstance(op, Comm) and op.kind == WAIT and op.of == SEND:
                pending.append(op.message.sent_by)
            elif isinstance(op, Action):
                if pending:
                    waits[op] = pending
                pending = []
    return MappingProxyType({b: tuple(ws) for b, ws in waits.items()})


def message_order(actions: Actions, placement: Sequence[int] | None = None) -> list[str]:
    """Pairs of ranks whose messages would be received in a different order than sent (one sentence each)."""
    position = {a: k for rank in flatten(actions) for k, a in enumerate(rank)}
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
