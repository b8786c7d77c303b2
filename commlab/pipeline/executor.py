"""The pipeline executor: runs one rank's action list for a training step, with checkpointing.

``loss = PipelineSchedule(stage, "1f1b", microbatches=8, loss_fn=F.cross_entropy).step(x, target=y)``

The executor walks this rank's actions in order. Before an action it waits for the one message
it needs (an activation for a forward, a gradient for a backward); after it, in one
``batch_isend_irecv``, it sends what the action produced and posts the receive for the next action
(the pairing torch.distributed.pipelining's schedules use, so that NCCL can match a send with the
peer's receive posted in the same batch). Sends are awaited only at the end of the step.

Each micro-batch's loss is scaled by its share of the mini-batch (n_i / N), so the summed
gradients equal those of the mean loss over the whole mini-batch, exactly as the unpartitioned
model computes it, even when the batch does not divide evenly.
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from commlab.pipeline.comm import Boundary, handshake, split_batch, tag
from commlab.pipeline.memory import SavedBytes
from commlab.pipeline.schedules import BACKWARD, FORWARD, SCHEDULES, Action, build
from commlab.pipeline.simulate import Timed
from commlab.pipeline.stage import Stage, check_stages
from commlab.pipeline.validate import validate

CHECKPOINT_MODES = ("never", "except_last", "always")


def check_plan(schedule: str, stages: int, ranks: int, microbatches: int, checkpoint: str = "never") -> int:
    """Validate a pipeline configuration before any process starts; return v (stages per rank)."""
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}: choose from {', '.join(SCHEDULES)}")
    if checkpoint not in CHECKPOINT_MODES:
        raise ValueError(f"unknown checkpoint mode {checkpoint!r}: choose from {', '.join(CHECKPOINT_MODES)}")
    if microbatches < 1:
        raise ValueError(f"micro-batches must be >= 1, got {microbatches}")
    virtual = check_stages(stages, ranks)
    if virtual > 1 and schedule != "interleaved":
        raise ValueError(
            f"more stages than ranks ({stages} stages, {ranks} ranks): schedule {schedule!r} runs "
            "one stage per rank; use the interleaved schedule or one stage per rank"
        )
    validate(build(schedule, ranks, microbatches, virtual))
    return virtual


class PipelineSchedule:
    """One training step of a pipeline: split the batch, run the actions, return the loss.

    ``checkpoint``: ``never`` keeps every activation; ``always`` recomputes every micro-batch's
    forward during its backward (GPipe's re-materialisation, Huang et al. 2019, section 2.3);
    ``except_last`` spares the last micro-batch, whose backward follows its forward at once on the
    last stage (torchgpipe's default).
    After :meth:`step`: ``timeline`` (this rank's compute intervals, seconds from the step start;
    on CUDA exact only with ``measure=True``, which synchronises after every action) and
    ``peak_saved_bytes`` (per local stage: activation bytes held for backward at the peak).
    ``timeout`` bounds every wait for a message, so a lost peer raises instead of hanging.
    """

    def __init__(
        self,
        stage: Stage,
        schedule: str = "1f1b",
        *,
        microbatches: int,
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        checkpoint: str = "never",
        timeout: float = 300.0,
        measure: bool = False,
    ):
        check_plan(schedule, stage.num_stages, stage.ranks, microbatches, checkpoint)
        self.stage = stage
        self.schedule = schedule
        self.microbatches = microbatches
        self.loss_fn = loss_fn
        self.checkpoint = checkpoint
        self.timeout = datetime.timedelta(seconds=timeout)
        self.measure = measure
        self.actions: tuple[Action, ...] = build(schedule, stage.ranks, microbatches, stage.virtual)[stage.rank]
        self._last_backward = {a.stage: a for a in self.actions if a.kind == BACKWARD}
        self._boundaries: dict[int, Boundary] | None = None
        self.timeline: list[Timed] = []
        self.peak_saved_bytes: dict[int, int] = {}
        self.started_at = 0.0

    # -- one step -------------------------------------------------------------------------------
    def step(self, inputs: torch.Tensor | None = None, *, target: torch.Tensor | None = None) -> torch.Tensor | None:
        st, m = self.stage, self.microbatches
        chunks = targets = None
        if st.is_first:
            if inputs is None:
                raise ValueError("the rank holding the first stage must pass the mini-batch to step()")
            chunks = split_batch(inputs.to(st.device), m, "the mini-batch")
        if st.is_last:
            if target is None:
                raise ValueError("the rank holding the last stage must pass target= to step()")
            targets = split_batch(target.to(st.device), m, "the target")
        if self._boundaries is None:
            self._boundaries = handshake(st, chunks)
        if chunks is not None and tuple(int(c.shape[0]) for c in chunks) != self._boundaries[0].sizes:
            raise ValueError("the mini-batch size changed since the first step; build a new PipelineSchedule")
        sizes = next(iter(self._boundaries.values())).sizes
        self._weights = [n / sum(sizes) for n in sizes]
        self._chunks, self._targets = chunks, targets
        self._stash: dict[tuple[int, int], tuple] = {}
        self._local: dict[Action, torch.Tensor] = {}
        self._live = {s: 0 for s in st.modules}
        self.peak_saved_bytes = {s: 0 for s in st.modules}
        self.timeline = []
        self._losses: list[torch.Tensor] = []
        pending_sends: list = []  # (works, tensor): the tensor must outlive its send
        posted = self._exchange([], self._recv_op(self.actions[0]))
        start = self.started_at = time.perf_counter()  # CLOCK_MONOTONIC: comparable across local ranks
        for k, action in enumerate(self.actions):
            message = posted.wait(self.timeout)
            began = time.perf_counter() - start
            produced = self._forward(action, message) if action.kind == FORWARD else self._backward(action, message)
            if self.measure and st.device.type == "cuda":
                torch.cuda.current_stream(st.device).synchronize()  # compute intervals, not launch times
            self.timeline.append(Timed(st.rank, action, began, time.perf_counter() - start))
            nxt = self._recv_op(self.actions[k + 1]) if k + 1 < len(self.actions) else None
            posted = self._exchange(self._send_ops(action, produced), nxt)
            pending_sends.append((posted.sends, produced))
        for works, _ in pending_sends:
            for w in works:
                w.wait(self.timeout)
        self._stash.clear()
        return torch.stack(self._losses).sum() if st.is_last else None

    # -- communication --------------------------------------------------------------------------
    def _peer_of(self, action: Action, send: bool) -> tuple[int, Action] | None:
        """(neighbour stage, message-producing action) for the message ``action`` sends or needs."""
        s, i, S = action.stage, action.microbatch, self.stage.num_stages
        if action.kind == FORWARD:
            other = s + 1 if send else s - 1
            producer = action if send else Action(s - 1, FORWARD, i)
        else:
            other = s - 1 if send else s + 1
            producer = action if send else Action(s + 1, BACKWARD, i)
        return (other, producer) if 0 <= other < S else None

    def _recv_op(self, action: Action):
        found = self._peer_of(action, send=False)
        if found is None or found[0] in self.stage.modules:
            return None
        other, producer = found
        boundary = self._boundaries[action.stage if action.kind == FORWARD else other]
        buf = boundary.buffer(action.microbatch, self.stage.device)
        peer = self.stage.global_rank_of(other)
        return buf, dist.P2POp(dist.irecv, buf, peer, self.stage.group, tag(producer, self.microbatches))

    def _send_ops(self, action: Action, produced: torch.Tensor | None) -> list:
        found = self._peer_of(action, send=True)
        if found is None or produced is None:
            return []
        other, producer = found
        if other in self.stage.modules:  # neighbour stage on this rank: hand over without a message
            nxt = Action(other, action.kind, action.microbatch)
            self._local[nxt] = produced
            return []
        peer = self.stage.global_rank_of(other)
        return [dist.P2POp(dist.isend, produced, peer, self.stage.group, tag(producer, self.microbatches))]

    def _exchange(self, send_ops: list, recv) -> _Posted:
        """Issue one action's send and the next action's receive as one batch."""
        ops = send_ops + ([recv[1]] if recv else [])
        works = dist.batch_isend_irecv(ops) if ops else []
        if len(works) != len(ops):  # NCCL may coalesce a batch into one work: wait for all of it
            return _Posted([], recv[0] if recv else None, works)
        return _Posted(works[: len(send_ops)], recv[0] if recv else None, works[len(send_ops) :])

    # -- compute --------------------------------------------------------------------------------
    def _checkpointed(self, microbatch: int) -> bool:
        return self.checkpoint == "always" or (self.checkpoint == "except_last" and microbatch < self.microbatches - 1)

    def _run(self, s: int, i: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        with self.stage.forward_context(s):
            y = self.stage.modules[s](x)
        loss = None
        if s == self.stage.num_stages - 1:
            loss = self.loss_fn(y, self._targets[i]) * self._weights[i]
        return y, loss

    def _forward(self, action: Action, message: torch.Tensor | None) -> torch.Tensor | None:
        s, i = action.stage, action.microbatch
        x = self._chunks[i] if s == 0 else (message if message is not None else self._local.pop(action))
        if s > 0 and x.is_floating_point():
            x = x.detach().requires_grad_(True)
        params = list(self.stage.modules[s].parameters())
        if self._checkpointed(i):
            rng = _rng_state(self.stage.device)
            with torch.no_grad():
                y, loss = self._run(s, i, x)
            nbytes = x.numel() * x.element_size()  # only the stage's input stays alive
            self._stash[(s, i)] = (x, rng, None, None, nbytes)
        else:
            with SavedBytes(params) as saved:
                y, loss = self._run(s, i, x)
            nbytes = saved.nbytes
            self._stash[(s, i)] = (x, None, y, loss, nbytes)
        self._live[s] += nbytes
        self.peak_saved_bytes[s] = max(self.peak_saved_bytes[s], self._live[s])
        if loss is not None:
            self._losses.append(loss.detach())
            return None
        return y.detach()

    def _backward(self, action: Action, message: torch.Tensor | None) -> torch.Tensor | None:
        s, i = action.stage, action.microbatch
        x, rng, y, loss, nbytes = self._stash.pop((s, i))
        if rng is not None:  # recompute the forward with the RNG state of the first run (dropout)
            with torch.random.fork_rng(devices=[self.stage.device] if self.stage.device.type == "cuda" else []):
                _set_rng_state(rng, self.stage.device)
                with torch.enable_grad(), SavedBytes(self.stage.modules[s].parameters()) as saved:
                    y, loss = self._run(s, i, x)
            self.peak_saved_bytes[s] = max(self.peak_saved_bytes[s], self._live[s] + saved.nbytes)
        grad = None
        if loss is None:
            grad = message if message is not None else self._local.pop(action)
        root = loss if loss is not None else y
        with self.stage.backward_context(s, self._last_backward[s] == action, [root]):
            torch.autograd.backward(root, grad_tensors=grad)
        self._live[s] -= nbytes
        if s > 0 and x.requires_grad:
            return x.grad
        return None


@dataclass
class _Posted:
    """What one batch of point-to-point ops left to wait for."""

    sends: list
    buffer: torch.Tensor | None  # the next action's incoming message
    recv_works: list

    def wait(self, timeout: datetime.timedelta) -> torch.Tensor | None:
        for w in self.recv_works:
            w.wait(timeout)
        return self.buffer


def _rng_state(device: torch.device) -> tuple:
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return (torch.get_rng_state(), cuda)


def _set_rng_state(state: tuple, device: torch.device) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state(state[1], device)
