"""The pipeline executor: runs one rank's action list for a training step, with checkpointing.

``loss = PipelineSchedule(stage, "1f1b", microbatches=8, loss_fn=F.cross_entropy).step(x, target=y)``

The schedule is a registered name (:data:`commlab.pipeline.schedules.REGISTRY`) or the per-rank
action lists themselves (:class:`Action` or strings such as "0F1", "0I1", "0W1"), e.g. read from
torch.distributed.pipelining's CSV; any list that :func:`validate` accepts runs.

The executor walks this rank's actions in order. Before an action it waits for the one message
it needs (an activation for a forward, a gradient for B or I; W needs none); after it, in one
batch, it sends what the action produced and posts the next receive: on NCCL the next action's,
on Gloo the next *receiving* action's (:func:`~commlab.pipeline.messages.receive_posts`;
:mod:`commlab.pipeline.transport`; NCCL also needs :func:`message_order`). What crosses a
boundary may be a tuple of tensors (:mod:`commlab.pipeline.values`). Each send is awaited as early
as it safely can be (:func:`commlab.pipeline.messages.send_waits`), which frees the sent tensor:
a Gloo send holds it until ``wait()``.

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

import torch
import torch.distributed as dist

from commlab.pipeline.actions import BACKWARD, FORWARD, INPUT_GRAD, WEIGHT_GRAD, Action
from commlab.pipeline.comm import agree, split_batch
from commlab.pipeline.compute import Stashed, forward_layers, input_grad, recompute, rng_state, weight_grad
from commlab.pipeline.memory import Ledger, SavedBytes
from commlab.pipeline.messages import message_order, receive_posts, send_waits
from commlab.pipeline.simulate import Timed, split_stages
from commlab.pipeline.stage import Stage
from commlab.pipeline.transport import Transport
from commlab.pipeline.validate import CHECKPOINT_MODES, check_plan, recomputes, resolve
from commlab.pipeline.values import Value, detached, flat, floats, leaf_grads, pairs

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
        self._nccl = str(dist.get_backend(stage.group)).lower() == "nccl"
        if self._nccl and message_order(all_actions, stage.placement):
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
        self._transport = Transport(stage, self.split, microbatches)
        self._shapes: dict = {}  # (stage, input boundary) -> output boundary
        self._known: dict = {}  # first stage's input boundary -> every stage's (comm.agree)
        self.timeline: list[Timed] = []
        self.peak_saved_bytes: dict[int, int] = {}
        self.memory: Ledger | None = None
        self.started_at = 0.0

    # -- one step -------------------------------------------------------------------------------
    def step(self, inputs: torch.Tensor | None = None, *, target: torch.Tensor | None = None) -> torch.Tensor | None:
        st, m = self.stage, self.microbatches
        chunks = targets = None
        error = None
        try:  # a refusal here reaches every rank through comm.agree, so every rank raises it
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
        boundaries = agree(st, chunks, self.timeout, error, self._known, self._shapes)
        sizes = next(iter(boundaries.values())).sizes
        self._weights = [n / sum(sizes) if self.loss_reduction == "mean" else 1.0 for n in sizes]
        self._chunks, self._targets = chunks, targets
        self._stash: dict[tuple[int, int], Stashed] = {}
        self._live = {s: 0 for s in st.modules}
        self.peak_saved_bytes = {s: 0 for s in st.modules}
        self.memory = Ledger() if self.track_memory else None
        self._transport.start(boundaries, self._hold if self.track_memory else None)
        self.timeline = []
        self._losses: list[torch.Tensor] = []
        in_flight: dict[Action, list] = {}  # action -> its send's works; the work holds the tensor
        # After action j (-1: now) post the receive of action post_for[j]; `pending` is its index.
        post_for = receive_posts([self._transport.receives(a) for a in self.actions], lookahead=not self._nccl)
        pending = post_for.get(-1)
        posted = self._transport.post(None, None, None if pending is None else self.actions[pending])
        start = self.started_at = time.perf_counter()  # CLOCK_MONOTONIC: comparable across local ranks
        for k, action in enumerate(self.actions):
            for sent in self._waits.get(action, ()):
                self._finish(sent, in_flight.pop(sent, []))
            message = posted.wait(self.timeout) if pending == k else None
            self._drop("recv", action)
            began = time.perf_counter() - start
            kind = action.kind
            produced = self._forward(action, message) if kind == FORWARD else self._backward(action, message)
            if self.measure and st.device.type == "cuda":
                torch.cuda.current_stream(st.device).synchronize()  # compute intervals, not launch times
            self.timeline.append(Timed(st.rank, action, began, time.perf_counter() - start))
            nxt = post_for.get(k)
            out = self._transport.post(action, produced, None if nxt is None else self.actions[nxt])
            if nxt is not None:
                posted, pending = out, nxt
            if out.sends:
                in_flight[action] = out.sends
        for sent, works in in_flight.items():
            self._finish(sent, works)
        self._stash.clear()
        return torch.stack(self._losses).sum() if st.is_last else None

    # -- memory accounting ----------------------------------------------------------------------
    def _hold(self, kind: str, action: Action, tensors=(), storages=None) -> None:
        """Account ``tensors`` / ``storages`` to a holder (see :class:`Ledger`)."""
        if self.memory is not None:
            self.memory.hold(kind, (action.stage, action.microbatch, action.kind), tensors, storages)

    def _drop(self, kind: str, action: Action) -> None:
        if self.memory is not None:
            self.memory.drop((kind, action.stage, action.microbatch, action.kind))

    def _finish(self, action: Action, works: list) -> None:
        for w in works:
            w.wait(self.timeout)
        self._drop("send", action)

    # -- compute --------------------------------------------------------------------------------
    def _run(self, s: int, i: int, x: Value):
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

    def _saved(self, s: int, x: Value):
        # The first stage's input is the caller's mini-batch (its micro-batches are views of it):
        # alive anyway, so not counted, like the parameters.
        if not self.track_memory:
            return _NoCount()
        return SavedBytes([*self.stage.modules[s].parameters(), *(flat(x) if s == 0 else [])])

    def _forward(self, action: Action, message: Value | None) -> Value | None:
        s, i = action.stage, action.microbatch
        if s == 0:
            x = self._chunks[i]
        else:
            x = message if message is not None else self._transport.take_local(action)
            self._drop("local", action)
            x = detached(x, grad=True)  # its floating elements' gradients go back to stage s - 1
        if recomputes(self.checkpoint, i, self.microbatches):
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
        return detached(y, grad=False)

    def _keep(self, s: int, i: int, stash: Stashed, storages: dict) -> None:
        self._stash[(s, i)] = stash
        if self.memory is None:
            return
        self._hold("stash", Action(s, FORWARD, i), [*(flat(stash.x) if s > 0 else ()), *flat(stash.y)], storages)
        held = self.memory.held_bytes("stash", (s, i, FORWARD))
        self._live[s] += held - stash.nbytes
        stash.nbytes = held
        self.peak_saved_bytes[s] = max(self.peak_saved_bytes[s], self._live[s])

    def _backward(self, action: Action, message: tuple | None) -> tuple | None:
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
            grad = message if message is not None else self._transport.take_local(action)
            self._drop("local", action)
        sends = s > 0 and bool(floats(stash.x))  # a gradient goes back for each floating input
        if action.kind == INPUT_GRAD:
            out = input_grad(stash.layers, grad, stash.loss)
            return (out or tuple(torch.zeros_like(t) for t in floats(stash.x))) if sends else None
        self._stash.pop((s, i))
        roots, grads = ([stash.loss], None) if stash.loss is not None else pairs(stash.y, grad)
        with self.stage.backward_context(s, self._last_backward[s] == action, roots):
            if roots and all(r.requires_grad for r in roots):
                torch.autograd.backward(roots, grad_tensors=grads)
        self._release(s, i, stash)
        return leaf_grads(stash.x) if sends else None

    def _release(self, s: int, i: int, stash: Stashed) -> None:
        self._live[s] -= stash.nbytes
        self._drop("stash", Action(s, FORWARD, i))


class _NoCount:
    tensors: dict = {}

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        return None
