"""One rank's point-to-point traffic in a step: the messages of the comm pass's SEND and RECV ops, in batches.

The executor issues each run of consecutive SEND and RECV ops of its lowered list
(:func:`commlab.pipeline.schedule.comm.lower_comm`) as one ``batch_isend_irecv`` (the pairing
torch.distributed.pipelining's schedules use, so that NCCL can match a send with the peer's
receive posted in the same batch). A value is sent as one message per tensor
(:mod:`commlab.pipeline.runtime.values`), each with its own tag; a gradient comes back for the
floating-point elements only. Neighbour stages on the same rank hand over without a message.
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch.distributed as dist

from commlab.pipeline.runtime.handshake import Boundary, tag
from commlab.pipeline.runtime.stages import RankStages
from commlab.pipeline.runtime.values import Value, flat, rebuild
from commlab.pipeline.schedule.actions import Action
from commlab.pipeline.schedule.comm import RECV, SEND, Comm, Message
from commlab.pipeline.schedule.kinds import consumer

Hold = Callable[[str, Action, list], None]  # (kind of holder, action, tensors): memory accounting


@dataclass
class Posted:
    """What one batch of point-to-point ops left to wait for."""

    sends: list
    message: Value | None  # the receive's incoming value or gradient (filled once waited for)
    recv_works: list

    def wait(self, timeout: datetime.timedelta) -> Value | None:
        for w in self.recv_works:
            w.wait(timeout)
        return self.message


@dataclass
class Batch:
    """One issued batch: the sends' works by sending action, the receive by consuming action."""

    sending: dict[Action, list]
    receiving: dict[Action, Posted]


class Transport:
    """Messages of ``stage``'s actions; ``split``: the stages whose backward is split into I and W."""

    def __init__(self, stage: RankStages, split: frozenset[int], microbatches: int):
        self.stage, self.split, self.microbatches = stage, split, microbatches
        self.boundaries: dict[int, Boundary] = {}
        self.local: dict[Action, Value] = {}  # hand-overs between stages on this rank
        self._hold: Hold = lambda kind, action, tensors: None

    def start(self, boundaries: dict[int, Boundary], hold: Hold | None) -> None:
        """A new step with these boundaries (from the handshake)."""
        self.boundaries, self.local = boundaries, {}
        self._hold = hold or (lambda kind, action, tensors: None)

    def _recv(self, m: Message) -> tuple[Value, list] | None:
        forward = m.taken_by.stage > m.sent_by.stage
        # The boundary between the two stages: the consumer's input forward, the sender's input back.
        boundary = self.boundaries[max(m.taken_by.stage, m.sent_by.stage)]
        bufs = boundary.buffers(m.taken_by.microbatch, self.stage.device, grads=not forward)
        if not bufs:  # no floating-point element: no gradient comes back
            return None
        peer = self.stage.global_rank_of(m.sent_by.stage)
        ops = [dist.P2POp(dist.irecv, b, peer, self.stage.group, tag(m.sent_by, self.microbatches, j))
               for j, b in enumerate(bufs)]  # fmt: skip
        return (rebuild(bufs, boundary.packed) if forward else tuple(bufs)), ops

    def _sends(self, m: Message, produced: Value | None) -> list:
        if produced is None:
            return []
        peer = self.stage.global_rank_of(m.taken_by.stage)
        # Gloo sends contiguous memory only; a slice of a stage's output (x[:, 6:]) is copied once.
        return [dist.P2POp(dist.isend, t.contiguous(), peer, self.stage.group, tag(m.sent_by, self.microbatches, j))
                for j, t in enumerate(flat(produced))]  # fmt: skip

    def hand_over(self, action: Action, produced: Value | None) -> None:
        """Keep what ``action`` produced for its consumer if that runs on this rank."""
        target = consumer(action, self.stage.num_stages, self.split)
        if target is not None and produced is not None and target.stage in self.stage.modules:
            self.local[target] = produced
            self._hold("local", target, list(flat(produced)))

    def post(self, sends: Sequence[tuple[Message, Value | None]], receive: Message | None) -> Posted:
        """Issue the sends (message, value) and ``receive``'s receive as one batch."""
        send_ops = [op for m, value in sends for op in self._sends(m, value)]
        recv = self._recv(receive) if receive is not None else None
        recv_ops = recv[1] if recv else []
        ops = send_ops + recv_ops
        works = dist.batch_isend_irecv(ops) if ops else []
        message = recv[0] if recv else None
        if recv:
            self._hold("recv", receive.taken_by, list(flat(message)))
        if len(works) != len(ops):  # NCCL may coalesce a batch into one work: wait for all of it,
            return Posted([], message, works) if recv else Posted(works, None, [])  # as a send if no receive
        if send_ops:  # the works hold the sent tensors until awaited (the executor drops this then)
            for m, _ in sends:
                self._hold("send", m.sent_by, [op.tensor for op in send_ops])
        return Posted(works[: len(send_ops)], message, works[len(send_ops) :])

    def post_ops(self, batch: Sequence[Comm], produced: dict[Action, Value | None]) -> Batch:
        """Issue a run of SEND and RECV ops as one batch (``produced``: what each sending action
        made; taken from it here)."""
        receive = next((c.message for c in batch if c.kind == RECV), None)
        sends = [(c.message, produced.pop(c.message.sent_by)) for c in batch if c.kind == SEND]
        posted = self.post(sends, receive)
        return Batch({m.sent_by: posted.sends for m, _ in sends if posted.sends},
                     {receive.taken_by: posted} if receive is not None else {})  # fmt: skip

    def take_local(self, action: Action) -> Value | None:
        return self.local.pop(action, None)


def run_lowered(ops: Sequence, transport: Transport, timeout: datetime.timedelta,
                compute: Callable[[Action, Value | None], Value | None],
                sent: Callable[[Action, list], None]) -> float:  # fmt: skip
    """Run one rank's lowered list: each run of SEND and RECV ops is one batch of point-to-point
    calls, a WAIT waits on an earlier send (``sent(action, works)``) or receive, and a compute
    action runs as ``compute(action, its incoming message)``, which returns what it sends.

    Returns the seconds this rank spent issuing the batches and in the WAITs: its time in
    point-to-point communication, host-side. A receive's wait also holds the time its peer had
    not yet sent (the schedule's bubble); on CUDA a wait only orders the stream, so there it is
    not the transfer's time."""
    clock, p2p = time.perf_counter, 0.0
    sending = {op.message.sent_by for op in ops if isinstance(op, Comm) and op.kind == SEND}
    produced: dict[Action, Value | None] = {}  # what an action sends, until its SEND
    messages: dict[Action, Value | None] = {}  # received, until its consumer runs
    in_flight: dict[Action, list] = {}  # sending action -> its works; a work holds the tensor
    received: dict[Action, Posted] = {}  # consuming action -> its posted receive
    batch: list[Comm] = []
    for op in (*ops, None):
        if isinstance(op, Comm) and op.kind in (SEND, RECV):
            batch.append(op)
            continue
        began = clock()
        if batch:
            posted = transport.post_ops(batch, produced)
            in_flight.update(posted.sending)
            received.update(posted.receiving)
            batch = []
        if op is None:
            return p2p + clock() - began
        if isinstance(op, Comm):  # WAIT on an earlier send or receive
            if op.of == SEND:
                sent(op.message.sent_by, in_flight.pop(op.message.sent_by, []))
            elif op.message.taken_by in received:
                messages[op.message.taken_by] = received.pop(op.message.taken_by).wait(timeout)
            p2p += clock() - began
            continue
        p2p += clock() - began  # the batch issued before this compute action (nothing when none)
        out = compute(op, messages.pop(op, None))
        if op in sending:
            produced[op] = out
