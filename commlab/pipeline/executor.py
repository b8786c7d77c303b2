"""The pipeline executor: runs one rank's action list for a training step, with checkpointing.

``loss = PipelineSchedule(stage, "1f1b", microbatches=8, loss_fn=F.cross_entropy).step(x, target=y)``

The schedule is a registered name (:data:`commlab.pipeline.schedules.REGISTRY`) or the per-rank
action lists themselves (:class:`Action` or strings such as "0F1", "0I1", "0W1"), e.g. read from
torch.distributed.pipelining's CSV; any list that :func:`validate` accepts runs.

The executor walks this rank's actions in order. Before an action it waits for the one message
it needs (an activation for a forward, a gradient for B or I; W needs none); after it, in one
``batch_isend_irecv``, it sends what the action produced and posts the receive for the next action
(the pairing torch.distributed.pipelining's schedules use, so that NCCL can match a send with the
peer's receive posted in the same batch; NCCL also needs :func:`message_order`). Each send is
awaited as early as it safely can be (:func:`commlab.pipeline.messages.send_waits`), which frees
the sent tensor: a Gloo send holds it until ``wait()``.

Loss scaling (``loss_reduction``): with ``"mean"`` (loss_fn averages over its micro-batch, as
F.cross_entropy does by default) micro-batch i's loss is scaled by its share n_i / N of the
mini-batch, so the summed gradients equal those of the mean loss over the whole mini-batch, exactly,
even when the batch does not divide evenly (torch.distributed.pipelining divides by m instead,
``scale_grads=True``, exact only for equal micro-batches). With ``"sum"`` (reduction='sum') the
losses are not scaled: the gradients are those of the summed loss. ``step`` returns the
mini-batch loss under the same reduction.
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from commlab.pipeline.actions import BACKWARD, FORWARD, INPUT_GRAD, WEIGHT_GRAD, Action
from commlab.pipeline.comm import Boundary, handshake, split_batch, tag
from commlab.pipeline.compute import Stashed, forward_layers, input_grad, recompute, rng_state, weight_grad
from commlab.pipeline.memory import Ledger, SavedBytes
from commlab.pipeline.messages import message_order, send_waits
from commlab.pipeline.simulate import Timed, split_stages
from commlab.pipeline.stage import Stage
from commlab.pipeline.validate import CHECKPOINT_MODES, check_plan, resolve

__all__ = ["CHECKPOINT_MODES", "LOSS_REDUCTIONS", "PipelineSchedule", "check_plan", "resolve"]

LOSS_REDUCTIONS = ("mean", "sum")


class PipelineSchedule:
    """One training step of a pipeline: split the batch, run the actions, return the loss.

    ``checkpoint``: ``never`` keeps every activation; ``always`` recomputes every micro-batch's
    forward during its backward (GPipe's re-materialisation, Huang et al. 2019, section 2.3);
    ``except_last`` spares the last micro-batch, whose backward follows its forward at once on the
    last stage (torchgpipe's default).
    After :meth:`step`: ``timeline`` (this rank's compute intervals, seconds from the step start;
    on CUDA exact only with ``measure=True``, which synchronises after every action),
    ``peak_saved_bytes`` (per local stage: activation bytes held for backward at the peak) and
    ``memory`` (the rank's :class:`~commlab.pipeline.memory.Ledger`: stashed micro-batches,
    receive buffers, sends in flight). ``track_memory=False`` turns the accounting and its
    saved-tensor hooks off, for timing. ``timeout`` bounds every wait for a message, so a lost
    peer raises instead of hanging.
    """

    def __init__(
        self,
        stage: Stage,
        schedule: str | Sequence[Sequence[Action | str]] = "1f1b",
        *,
        microbatches: int,
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        checkpoint: str = "never",
        loss_reduction: str = "mean",
        timeout: float = 300.0,
        measure: bool = False,
        track_memory: bool = True,
    ):
        if loss_reduction not in LOSS_REDUCTIONS:
            raise ValueError(f"unknown loss_reduction {loss_reduction!r}: choose from {', '.join(LOSS_REDUCTIONS)}")
        if checkpoint not in CHECKPOINT_MODES:
            raise ValueError(f"unknown checkpoint mode {checkpoint!r}: choose from {', '.join(CHECKPOINT_MODES)}")
        all_actions = resolve(schedule, stage.ranks, microbatches, stage.num_stages, stage.placement)
        self.split = split_stages(all_actions)
        if self.split and not stage.supports_split_backward:
            raise ValueError(f"{type(stage).__name__} cannot run a split backward (I and W actions); use B")
        if str(dist.get_backend(stage.group)).lower() == "nccl" and message_order(all_actions, stage.placement):
            raise ValueError("NCCL matches messages in issue order, and this schedule receives in another order:\n  "
                             + "\n  ".join(message_order(all_actions, stage.placement)))  # fmt: skip
        self.stage = stage
        self.schedule = schedule if isinstance(schedule, str) else "custom"
        self.all_actions = all_actions
        self.microbatches = microbatches
        self.loss_fn = loss_fn
        self.checkpoint = checkpoint
        self.loss_reduction = loss_reduction
        self.timeout = datetime.timedelta(seconds=timeout)
        self.measure = measure
        self.track_memory = track_memory
        self.actions: tuple[Action, ...] = all_actions[stage.rank]
        self._waits = send_waits(all_actions, stage.placement)
        self._last_backward = {a.stage: a for a in self.actions if a.kind in (BACKWARD, WEIGHT_GRAD)}
        self._boundaries: dict[int, Boundary] | None = None
        self._shapes: dict = {}  # (stage, input boundary) -> output boundary
        self.timeline: list[Timed] = []
        self.peak_saved_bytes: dict[int, int] = {}
        self.memory: Ledger | None = None
        self.started_at = 0.0

    # -- one step -------------------------------------------------------------------------------
    def step(self, inputs: torch.Tensor | None = None, *, target: torch.Tensor | None = None) -> torch.Tensor | None:
        st, m = self.stage, self.microbatches
        chunks = targets = None
        error = None
        try:  # a refusal here travels down the handshake, so every later rank raises it too
            if st.is_first:
                if inputs is None:
                    raise ValueError("the rank holding the first stage must pass the mini-batch to step()")
                chunks = split_batch(inputs.to(st.device), m, "the mini-batch")
            if st.is_last:
                if target is None:
                    raise ValueError("the rank holding the last stage must pass target= to step()")
                targets = split_batch(target.to(st.device), m, "the target")
        except ValueError as err:
            error = str(err)
        self._boundaries = handshake(st, chunks, self.timeout, error, self._shapes)
        sizes = next(iter(self._boundaries.values())).sizes
        self._weights = [n / sum(sizes) if self.loss_reduction == "mean" else 1.0 for n in sizes]
        self._chunks, self._targets = chunks, targets
        self._stash: dict[tuple[int, int], Stashed] = {}
        self._local: dict[Action, torch.Tensor] = {}
        self._live = {s: 0 for s in st.modules}
        self.peak_saved_bytes = {s: 0 for s in st.modules}
        self.memory = Ledger() if self.track_memory else None
        self.timeline = []
        self._losses: list[torch.Tensor] = []
        in_flight: dict[Action, list] = {}  # action -> its send's works; the work holds the tensor
        posted = self._exchange([], self._recv_op(self.actions[0]), self.actions[0])
        start = self.started_at = time.perf_counter()  # CLOCK_MONOTONIC: comparable across local ranks
        for k, action in enumerate(self.actions):
            for sent in self._waits.get(action, ()):
                self._finish(sent, in_flight.pop(sent, []))
            message = posted.wait(self.timeout)
            self._drop("recv", action)
            began = time.perf_counter() - start
            kind = action.kind
            produced = self._forward(action, message) if kind == FORWARD else self._backward(action, message)
            if self.measure and st.device.type == "cuda":
                torch.cuda.current_stream(st.device).synchronize()  # compute intervals, not launch times
            self.timeline.append(Timed(st.rank, action, began, time.perf_counter() - start))
            nxt = self.actions[k + 1] if k + 1 < len(self.actions) else None
            posted = self._exchange(self._send_ops(action, produced), self._recv_op(nxt) if nxt else None, nxt)
            if posted.sends:
                in_flight[action] = posted.sends
                self._hold("send", action, [produced])
        for sent, works in in_flight.items():
            self._finish(sent, works)
        self._stash.clear()
        return torch.stack(self._losses).sum() if st.is_last else None

    # -- memory accounting ----------------------------------------------------------------------
    def _hold(self, kind: str, action: Action, tensors=(), storages=None) -> None:
        if self.memory is not None:
            self.memory.hold(kind, (action.stage, action.microbatch, action.kind), tensors, storages)

    def _drop(self, kind: str, action: Action) -> None:
        if self.memory is not None:
            self.memory.drop((kind, action.stage, action.microbatch, action.kind))

    def _finish(self, action: Action, works: list) -> None:
        for w in works:
            w.wait(self.timeout)
        self._drop("send", action)

    # -- communication --------------------------------------------------------------------------
    def _peer_of(self, action: Action, send: bool) -> tuple[int, Action] | None:
        """(neighbour stage, message-producing action) for the message ``action`` sends or needs."""
        s, i, S = action.stage, action.microbatch, self.stage.num_stages
        if action.kind == WEIGHT_GRAD:
            return None
        forward = action.kind == FORWARD
        other = s + 1 if forward == send else s - 1
        if not 0 <= other < S:
            return None
        if send:
            return other, action
        return other, Action(other, FORWARD if forward else INPUT_GRAD if other in self.split else BACKWARD, i)

    def _recv_op(self, action: Action):
        found = self._peer_of(action, send=False)
        if found is None or found[0] in self.stage.modules:
            return None
        other, producer = found
        boundary = self._boundaries[action.stage if action.kind == FORWARD else other]
        if action.kind != FORWARD and not boundary.dtype.is_floating_point:
            return None  # a whole-number boundary (token ids) carries no gradient back
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
            if action.kind != FORWARD:
                nxt = Action(other, INPUT_GRAD if other in self.split else BACKWARD, action.microbatch)
            self._local[nxt] = produced
            self._hold("local", nxt, [produced])
            return []
        peer = self.stage.global_rank_of(other)
        return [dist.P2POp(dist.isend, produced, peer, self.stage.group, tag(producer, self.microbatches))]

    def _exchange(self, send_ops: list, recv, receiver: Action | None) -> _Posted:
        """Issue one action's send and the next action's receive as one batch."""
        ops = send_ops + ([recv[1]] if recv else [])
        works = dist.batch_isend_irecv(ops) if ops else []
        if recv and receiver is not None:
            self._hold("recv", receiver, [recv[0]])
        if len(works) != len(ops):  # NCCL may coalesce a batch into one work: wait for all of it
            return _Posted([], recv[0] if recv else None, works)
        return _Posted(works[: len(send_ops)], recv[0] if recv else None, works[len(send_ops) :])

    # -- compute --------------------------------------------------------------------------------
    def _checkpointed(self, microbatch: int) -> bool:
        return self.checkpoint == "always" or (self.checkpoint == "except_last" and microbatch < self.microbatches - 1)

    def _run(self, s: int, i: int, x: torch.Tensor):
        layers = []
        with self.stage.forward_context(s):
            if s in self.split and torch.is_grad_enabled():
                y, layers = forward_layers(self.stage.modules[s], x)
            else:
                y = self.stage.modules[s](x)
        loss = None
        if s == self.stage.num_stages - 1:
            loss = self.loss_fn(y, self._targets[i]) * self._weights[i]
        return y, loss, layers

    def _saved(self, s: int, x: torch.Tensor):
        # The first stage's input is the caller's mini-batch (its micro-batches are views of it):
        # alive anyway, so not counted, like the parameters.
        if not self.track_memory:
            return _NoCount()
        return SavedBytes([*self.stage.modules[s].parameters(), *([x] if s == 0 else [])])

    def _forward(self, action: Action, message: torch.Tensor | None) -> torch.Tensor | None:
        s, i = action.stage, action.microbatch
        if s == 0:
            x = self._chunks[i]
        else:
            x = message if message is not None else self._local.pop(action)
            self._drop("local", action)
        if s > 0 and x.is_floating_point():
            x = x.detach().requires_grad_(True)
        if self._checkpointed(i):
            rng = rng_state(self.stage.device)
            with torch.no_grad():
                y, loss, _ = self._run(s, i, x)
            stash = Stashed(x, rng)  # only the stage's input stays alive
            storages = {}
        else:
            with self._saved(s, x) as saved:
                y, loss, layers = self._run(s, i, x)
            stash = Stashed(x, None, y, loss, layers)
            storages = saved.tensors
        self._keep(s, i, stash, storages)
        if loss is not None:
            self._losses.append(loss.detach())
            return None
        return y.detach()

    def _keep(self, s: int, i: int, stash: Stashed, storages: dict) -> None:
        self._stash[(s, i)] = stash
        if self.memory is None:
            return
        self._hold("stash", Action(s, FORWARD, i), [stash.x if s > 0 else None, stash.y], storages)
        held = self.memory._holders[("stash", s, i, FORWARD)][1]
        self._live[s] += sum(held.values()) - stash.nbytes
        stash.nbytes = sum(held.values())
        self.peak_saved_bytes[s] = max(self.peak_saved_bytes[s], self._live[s])

    def _backward(self, action: Action, message: torch.Tensor | None) -> torch.Tensor | None:
        s, i = action.stage, action.microbatch
        if action.kind == WEIGHT_GRAD:
            stash = self._stash.pop((s, i))
            weight_grad(stash.layers)
            self._release(s, i, stash)
            return None
        stash = self._stash[(s, i)]
        if stash.rng is not None:  # recompute the forward with the RNG state of the first run (dropout)
            with self._saved(s, stash.x) as saved:
                stash.y, stash.loss, stash.layers = recompute(
                    self.stage.modules[s], self.stage.device, stash.rng, lambda: self._run(s, i, stash.x))
            stash.rng = None
            self._keep(s, i, stash, saved.tensors)
        grad = None
        if stash.loss is None:
            grad = message if message is not None else self._local.pop(action, None)
            self._drop("local", action)
        x = stash.x
        if action.kind == INPUT_GRAD:
            out = input_grad(stash.layers, grad, stash.loss)
            return out if s > 0 and x.requires_grad else None
        self._stash.pop((s, i))
        root = stash.loss if stash.loss is not None else stash.y
        with self.stage.backward_context(s, self._last_backward[s] == action, [root]):
            if root.requires_grad and (grad is not None or stash.loss is not None):
                torch.autograd.backward(root, grad_tensors=grad)
        self._release(s, i, stash)
        if s > 0 and x.requires_grad:
            return x.grad if x.grad is not None else torch.zeros_like(x)
        return None

    def _release(self, s: int, i: int, stash: Stashed) -> None:
        self._live[s] -= stash.nbytes
        self._drop("stash", Action(s, FORWARD, i))


class _NoCount:
    tensors: dict = {}

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
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
