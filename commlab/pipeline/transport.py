"""One rank's point-to-point traffic in a step: which message an action sends or needs, posted in batches.

After each action the executor issues, in one ``batch_isend_irecv``, the sends of what the action
produced and the receive for the next action (the pairing torch.distributed.pipelining's
schedules use, so that NCCL can match a send with the peer's receive posted in the same batch).
A value is sent as one message per tensor (:mod:`commlab.pipeline.values`), each with its own tag;
a gradient comes back for the floating-point elements only. Neighbour stages on the same rank
hand over without a message.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable
from dataclasses import dataclass

import torch.distributed as dist

from commlab.pipeline.actions import FORWARD, Action
from commlab.pipeline.comm import Boundary, tag
from commlab.pipeline.messages import consumer, producer
from commlab.pipeline.stage import Stage
from commlab.pipeline.values import Value, flat, rebuild

Hold = Callable[[str, Action, list], None]  # (kind of holder, action, tensors): memory accounting


@dataclass
class Posted:
    """What one batch of point-to-point ops left to wait for."""

    sends: list
    message: Value | None  # the next action's incoming value or gradient (filled once waited for)
    recv_works: list

    def wait(self, timeout: datetime.timedelta) -> Value | None:
        for w in self.recv_works:
            w.wait(timeout)
        return self.message


class Transport:
    """Messages of ``stage``'s actions; ``split``: the stages whose backward is split into I and W."""

    def __init__(self, stage: Stage, split: frozenset[int], microbatches: int):
        self.stage, self.split, self.microbatches = stage, split, microbatches
        self.boundaries: dict[int, Boundary] = {}
        self.local: dict[Action, Value] = {}  # hand-overs between stages on this rank
        self._hold: Hold = lambda kind, action, tensors: None

    def start(self, boundaries: dict[int, Boundary], hold: Hold | None) -> None:
        """A new step with these boundaries (from the handshake)."""
        self.boundaries, self.local = boundaries, {}
        self._hold = hold or (lambda kind, action, tensors: None)

    def receives(self, action: Action) -> bool:
        """Whether ``action`` takes a message from another rank (what :meth:`post` receives for it)."""
        source = producer(action, self.stage.num_stages, self.split)
        if source is None or source.stage in self.stage.modules:
            return False
        if action.kind == FORWARD:
            return True
        return any(d.is_floating_point for d in self.boundaries[source.stage].dtypes)  # gradients: floats only

    def _recv(self, action: Action) -> tuple[Value, list] | None:
        if not self.receives(action):
            return None
        source = producer(action, self.stage.num_stages, self.split)
        other, forward = source.stage, action.kind == FORWARD
        boundary = self.boundaries[action.stage if forward else other]
        bufs = boundary.buffers(action.microbatch, self.stage.device, grads=not forward)
        peer = self.stage.global_rank_of(other)
        ops = [dist.P2POp(dist.irecv, b, peer, self.stage.group, tag(source, self.microbatches, j))
               for j, b in enumerate(bufs)]  # fmt: skip
        return (rebuild(bufs, boundary.packed) if forward else tuple(bufs)), ops

    def _sends(self, action: Action, produced: Value | None) -> list:
        target = consumer(action, self.stage.num_stages, self.split)
        if target is None or produced is None:
            return []
        if target.stage in self.stage.modules:  # neighbour stage on this rank: hand over without a message
            self.local[target] = produced
            self._hold("local", target, list(flat(produced)))
            return []
        peer = self.stage.global_rank_of(target.stage)
        # Gloo sends contiguous memory only; a slice of a stage's output (x[:, 6:]) is copied once.
        return [dist.P2POp(dist.isend, t.contiguous(), peer, self.stage.group, tag(action, self.microbatches, j))
                for j, t in enumerate(flat(produced))]  # fmt: skip

    def post(self, action: Action | None, produced: Value | None, receiver: Action | None) -> Posted:
        """Issue ``action``'s sends of ``produced`` and ``receiver``'s receive as one batch."""
        send_ops = self._sends(action, produced) if action is not None else []
        recv = self._recv(receiver) if receiver is not None else None
        recv_ops = recv[1] if recv else []
        ops = send_ops + recv_ops
        works = dist.batch_isend_irecv(ops) if ops else []
        message = recv[0] if recv else None
        if recv:
            self._hold("recv", receiver, list(flat(message)))
        if len(works) != len(ops):  # NCCL may coalesce a batch into one work: wait for all of it,
            return Posted([], message, works) if recv else Posted(works, None, [])  # as a send if no receive
        if send_ops:  # the works hold the sent tensors until awaited (the executor drops this then)
            self._hold("send", action, [op.tensor for op in send_ops])
        return Posted(works[: len(send_ops)], message, works[len(send_ops) :])

    def take_local(self, action: Action) -> Value | None:
        return self.local.pop(action, None)
