"""Lowered lists as tasks on the shared discrete-event core (:mod:`commlab.sim`).

Every compute action becomes a task on its rank (``rank{r}``), in the rank's order. Every SEND
becomes a task ``msg {a}>{c}`` on the channel between the two ranks, after the producing action
and (``posting``) after the compute action the receiver's RECV op follows: a send completes only
once its receive is posted. A ``WAIT RECV`` makes the consuming action depend on the message, a
``WAIT SEND`` (``waits``) the next compute action. With ``contention`` a channel carries one
message at a time in the sender's order, where the receiver takes them in that order too
(NCCL-style); otherwise (Gloo tags) messages do not queue. Costs are the caller's: the pure
analysis (:func:`commlab.pipeline.schedule.simulate.simulate`) and the cost lowering
(:func:`commlab.costmodel.lowering.pipeline.lower`) both build on this.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from commlab.pipeline.schedule.actions import Action
from commlab.pipeline.schedule.comm import RECV, SEND, WAIT, Lowered, Message, compute_only, message_order
from commlab.pipeline.schedule.kinds import dependencies, split_stages
from commlab.sim import Task


def tasks(
    lowered: Lowered,
    seconds: Callable[[Action], float],
    message_seconds: Callable[[Message], float],
    *,
    posting: bool = True,
    waits: bool = True,
    contention: bool = True,
    after: Mapping[Action, Sequence[Action]] | None = None,
) -> list[Task]:
    """The tasks of one step (module docstring); ``after``: extra dependencies between actions."""
    actions = compute_only(lowered)
    rank_of = {a: r for r, rank in enumerate(actions) for a in rank}
    stages, split = 1 + max((a.stage for a in rank_of), default=-1), split_stages(actions)
    contention = contention and not message_order(actions)
    posted_after: dict[Message, str] = {}  # message -> the compute action its receive follows
    for rank in lowered:
        last = None
        for op in rank:
            if isinstance(op, Action):
                last = str(op)
            elif op.kind == RECV and last is not None:
                posted_after[op.message] = last
    deps: dict[Action, list[str]] = {a: [] for a in rank_of}
    transfers: list[Task] = []
    for r, rank in enumerate(lowered):
        pending: list[str] = []  # message tasks the next compute action waits for
        for op in rank:
            if isinstance(op, Action):
                # A neighbour stage on the same rank hands over without a message.
                deps[op] += [str(d) for d in dependencies(op, stages, split) if rank_of.get(d) == r and d.stage != op.stage]
                deps[op] += pending
                pending = []
            elif op.kind == SEND:
                m = op.message
                posted = (posted_after[m],) if posting and m in posted_after else ()
                channel = f"p2p{m.src}>{m.dst}" if contention else f"msg {m}"
                transfers.append(Task(f"msg {m}", channel, message_seconds(m), (str(m.sent_by), *posted), kind="p2p",
                                      meta={"message": m}))  # fmt: skip
            elif op.kind == WAIT and (op.of == RECV or waits):
                pending.append(f"msg {op.message}")
    for a, extra in (after or {}).items():
        deps[a] += [str(e) for e in extra]
    out = [Task(str(a), f"rank{r}", seconds(a), tuple(deps[a]), kind=a.kind, meta={"rank": r, "action": a})
           for r, rank in enumerate(actions) for a in rank]  # fmt: skip
    return out + transfers

