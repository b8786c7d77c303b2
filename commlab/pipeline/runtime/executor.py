"""The pipeline executor: runs one rank's lowered action list for a training step, with checkpointing.

``loss = PipelineExecutor(stages, "1f1b", microbatches=8, loss_fn=F.cross_entropy).step(x, target=y)``; a
traced model takes torch's call: ``step(tokens, attention_mask=mask, target=y, losses=ls)``, ``eval_step(...)``.

The schedule is a registered name (:data:`commlab.pipeline.schedule.registry.REGISTRY`) or the per-rank
action lists themselves (:class:`Action` or strings such as "0F1", "0I1", "0W1"), e.g. read from
torch.distributed.pipelining's CSV; any list that :func:`validate` accepts runs.

The executor runs this rank's list from the comm pass (:func:`~commlab.pipeline.schedule.comm.lower_comm`,
for the group's backend): each run of SEND and RECV ops is one batch of point-to-point calls
(:mod:`commlab.pipeline.runtime.transport`), a WAIT waits on an earlier send or receive, and a compute
action runs its kind's handler (:data:`HANDLERS`). What crosses a boundary may be a tuple of tensors
(:mod:`commlab.pipeline.runtime.values`). Which micro-batches' activations stay alive, and when
they are freed, follows :func:`commlab.pipeline.schedule.liveness.liveness`.

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

from commlab._lazy import renamed_getattr
from commlab.pipeline.runtime.compute import Stashed, forward_layers, full_grad, input_grad, recompute, rng_state, weight_grad
from commlab.pipeline.runtime.chunks import merge, step_inputs
from commlab.pipeline.runtime.handshake import agree
from commlab.pipeline.runtime.memory import Ledger, NoCount, SavedBytes
from commlab.pipeline.runtime.stages import RankStages
from commlab.pipeline.runtime.transport import Transport, run_lowered
from commlab.pipeline.runtime.values import Value, detached, flat, floats, leaf_grads, pairs
from commlab.pipeline.schedule.actions import BACKWARD, FORWARD, INPUT_GRAD, WEIGHT_GRAD, Action, flatten
from commlab.pipeline.schedule.comm import lower_comm, message_order
from commlab.pipeline.schedule.kinds import split_stages
from commlab.pipeline.schedule.liveness import liveness
from commlab.pipeline.schedule.simulate import Timed
from commlab.pipeline.schedule.checks import CHECKPOINT_MODES, check_plan, recomputes, resolve

__all__ = ["CHECKPOINT_MODES", "HANDLERS", "LOSS_REDUCTIONS", "PipelineExecutor", "check_plan", "resolve"]

LOSS_REDUCTIONS = ("mean", "sum")


class PipelineExecutor:
    """One training step of a pipeline: split the batch, run the actions, return the loss.

    ``checkpoint``: ``never`` keeps every activation; ``always`` recomputes every micro-batch's
    forward during its backward (GPipe's re-materialisation, Huang et al. 2019, section 2.3);
    ``except_last`` spares the last micro-batch, whose backward follows its forward at once on the
    last stage (torchgpipe's default).
    After :meth:`step`: ``timeline`` (this rank's compute intervals, seconds from the step start;
    on CUDA exact only with ``measure=True``, which synchronises after every action),
    ``peak_saved_bytes`` (per local stage: activation bytes held for backward at the peak),
    ``memory`` (the rank's :class:`~commlab.pipeline.runtime.memory.Ledger`: stashed micro-batches,
    receive buffers, sends in flight) and ``p2p_seconds`` (in sends and receives: ``run_lowered``).
    ``track_memory=False`` turns the accounting and its saved-tensor hooks off, for timing.
    ``timeout`` bounds every wait for a message, so a lost peer raises instead of hanging.
    """

    def __init__(
        self,
        stage: RankStages,
        schedule: str | Sequence[Sequence[Action | str]] = "1f1b",
        *,
        microbatches: int,
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        checkpoint: str = "never",
        loss_reduction: str = "mean",
        timeout: float = 300.0,
        measure: bool = False,
        track_memory: bool = True,
        args_chunk_spec: Sequence | None = None,
        kwargs_chunk_spec: dict | None = None,
    ):
        if loss_reduction not in LOSS_REDUCTIONS:
            raise ValueError(f"unknown loss_reduction {loss_reduction!r}: choose from {', '.join(LOSS_REDUCTIONS)}")
        if checkpoint not in CHECKPOINT_MODES:
            raise ValueError(f"unknown checkpoint mode {checkpoint!r}: choose from {', '.join(CHECKPOINT_MODES)}")
        all_actions = flatten(resolve(schedule, stage.ranks, microbatches, stage.num_stages, stage.placement))
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
        self.measure, self.track_memory = measure, track_memory
        self.args_chunk_spec, self.kwargs_chunk_spec = args_chunk_spec, kwargs_chunk_spec
        self._evaluating = False
        self.actions: tuple[Action, ...] = all_actions[stage.rank]
        self.ops = lower_comm(all_actions, stage.placement, "nccl" if self._nccl else "gloo")[stage.rank]
        forward = tuple(tuple(a for a in rank if a.kind == FORWARD) for rank in all_actions)  # eval_step's list
        self._eval_ops = lower_comm(forward, stage.placement, "nccl" if self._nccl else "gloo")[stage.rank]
        self._freed = {live.action: live.freed for live in liveness(all_actions)[stage.rank]}
        self._last_backward = {a.stage: a for a in self.actions if a.kind in (BACKWARD, WEIGHT_GRAD)}
        # An I directly followed by its own W runs both in one pass (compute.full_grad); its W is then empty.
        self._fused = {w for a, w in zip(self.actions, self.actions[1:]) if a.kind == INPUT_GRAD and w == a.at(a.stage, w.kind)}
        self._transport = Transport(stage, self.split, microbatches)
        self._shapes: dict = {}  # (stage, input boundary) -> output boundary
        self._known: dict = {}  # first stage's input boundary -> every stage's (handshake.agree)
        self.timeline: list[Timed] = []
        self.peak_saved_bytes: dict[int, int] = {}
        self.memory: Ledger | None = None
        self.started_at = self.p2p_seconds = 0.0

    # -- one step -------------------------------------------------------------------------------
    def step(self, *args, target: torch.Tensor | None = None, losses: list | None = None, **kwargs) -> torch.Tensor | None:
        """One training step: ``args``/``kwargs`` (each tensor chunked by its chunk spec) on the first
        stage's rank, ``target`` on the last's. Returns the mini-batch loss there (None elsewhere),
        and appends each micro-batch's loss, unscaled, to ``losses`` (torch's ``step(..., losses=)``)."""
        self._prepare(args, kwargs, target, need_target=True)
        self._run_ops(self.ops)
        self._stash.clear()
        if losses is not None and self.stage.is_last:
            losses.extend(self._raw_losses[i] for i in range(self.microbatches))
        return sum(self._raw_losses[i] * w for i, w in enumerate(self._weights)) if self.stage.is_last else None

    def eval_step(self, *args, target: torch.Tensor | None = None, losses: list | None = None, **kwargs):
        """Forward only (torch's ``eval()``): the outputs merged along dim 0 on the last stage's rank."""
        self._prepare(args, kwargs, target, need_target=False)
        self._outputs: dict[int, Value] = {}
        self._evaluating = True
        try:
            with torch.no_grad():
                self._run_ops(self._eval_ops)
        finally:
            self._evaluating = False
        if losses is not None and self.stage.is_last and target is not None:
            losses.extend(self._raw_losses[i] for i in range(self.microbatches))
        return merge([self._outputs[i] for i in range(self.microbatches)]) if self.stage.is_last else None

    def _prepare(self, args: tuple, kwargs: dict, target: torch.Tensor | None, need_target: bool) -> None:
        st = self.stage
        # A refusal here reaches every rank through handshake.agree, so every rank raises it.
        chunks, targets, error = step_inputs(st, args, kwargs, target if st.is_last else None, self.microbatches,
                                             self.args_chunk_spec, self.kwargs_chunk_spec, need_target)  # fmt: skip
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
        self._raw_losses: dict[int, torch.Tensor] = {}

    def _run_ops(self, ops) -> None:
        self.started_at = time.perf_counter()  # CLOCK_MONOTONIC: comparable across local ranks
        self.p2p_seconds = run_lowered(ops, self._transport, self.timeout, self._run_action, self._finish)

    def _run_action(self, action: Action, message: Value | None) -> Value | None:
        st = self.stage
        self._drop("recv", action)
        began = time.perf_counter() - self.started_at
        produced = HANDLERS[action.kind](self, action, message)
        if self.measure and st.device.type == "cuda":
            torch.cuda.current_stream(st.device).synchronize()  # compute intervals, not launch times
        self.timeline.append(Timed(st.rank, action, began, time.perf_counter() - self.started_at))
        for s, i in self._freed.get(action, ()):  # activations the schedule's liveness frees after this action
            self._live[s] -= self._stash.pop((s, i)).nbytes
            self._drop("stash", Action(s, FORWARD, i))
        self._transport.hand_over(action, produced)
        return produced

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
        if s == self.stage.num_stages - 1 and self._targets is not None:
            raw = self.loss_fn(y, self._targets[i])
            self._raw_losses[i] = raw.detach()  # keyed: a checkpoint's recomputation gives it again
            loss = raw * self._weights[i]
        return y, loss, layers

    def _saved(self, s: int, x: Value):
        # The first stage's input is the caller's mini-batch (its micro-batches are views of it):
        # alive anyway, so not counted, like the parameters.
        if not self.track_memory:
            return NoCount()
        return SavedBytes([*self.stage.modules[s].parameters(), *(flat(x) if s == 0 else [])])

    def _forward(self, action: Action, message: Value | None) -> Value | None:
        s, i = action.stage, action.microbatch
        if s == 0:
            x = self._chunks[i]
        else:
            x = message if message is not None else self._transport.take_local(action)
            self._drop("local", action)
            x = detached(x, grad=True)  # its floating elements' gradients go back to stage s - 1
        if self._evaluating:  # forward only: the last stage's output is kept for eval_step
            y, last = self._run(s, i, x)[0], s == self.stage.num_stages - 1
            self._outputs.update({i: y} if last else {})
            return None if last else y
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
        return None if loss is not None else detached(y, grad=False)

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
        if action.kind == WEIGHT_GRAD:  # outputs None: the weights-only half of a split backward
            if action not in self._fused:  # a fused W ran with its I, in the I's context
                with self.stage.backward_context(s, self._last_backward[s] == action, None):
                    weight_grad(self._stash[(s, i)].layers)
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
        if action.kind == INPUT_GRAD:  # the stage's last backward only when its W, the last, is fused into it
            w = action.at(s, WEIGHT_GRAD)
            with self.stage.backward_context(s, w in self._fused and self._last_backward[s] == w, None):
                run = full_grad if w in self._fused else input_grad
                out = run(stash.layers, grad, stash.loss)
            return (out or tuple(torch.zeros_like(t) for t in floats(stash.x))) if sends else None
        roots, grads = ([stash.loss], None) if stash.loss is not None else pairs(stash.y, grad)
        with self.stage.backward_context(s, self._last_backward[s] == action, roots):
            if roots and all(r.requires_grad for r in roots):
                torch.autograd.backward(roots, grad_tensors=grads)
        return leaf_grads(stash.x) if sends else None


# What each action kind runs: (executor, action, its incoming message) -> what it sends, or None. An
# overlap (O) runs as its parts (flattened above; lower_comm posts its forward's sends before its backward).
HANDLERS: dict[str, Callable[[PipelineExecutor, Action, Value | None], Value | None]] = {
    FORWARD: PipelineExecutor._forward,
    BACKWARD: PipelineExecutor._backward,
    INPUT_GRAD: PipelineExecutor._backward,
    WEIGHT_GRAD: PipelineExecutor._backward,
}
__getattr__ = renamed_getattr(__name__, {"PipelineSchedule": "PipelineExecutor"})  # old name: it runs a schedule
