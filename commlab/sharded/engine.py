"""The sharded step's life cycle: gathers, frees and reductions, driven by module and gradient hooks.

One iteration, bucket by bucket (buckets in forward order 0..n-1):

1. Forward start (the wrapper's forward). Stage 1 drops the full gradients of the last synchronised
   backward. Stages 1-2, if the shards changed since the last gather and step 6 did not gather
   them: every bucket's all-gather is queued (step 6's window).
2. A forward pre-hook on each module that uses bucket b (its unit, or the modules holding its
   parameters) waits for b's all-gather, then copies the gathered rank-major buffer out into
   the parameters (commlab/sharded/copies.py). Stage 3 first launches the all-gathers of b and of
   the ``prefetch`` buckets after it not gathered, and of every earlier bucket not gathered in this
   forward (the end of forward gathers the rest), so that a module skipped on one rank leaves its
   all-gathers in the others' order; the copy-out fills storage allocated again.
3. Stage 3 with ``reshard_after_forward``: a forward post-hook frees b (storage resized to 0)
   once every module using it has run (the end of forward frees the others), except buckets the
   root module uses itself (needed again at once, as torch's fully_shard keeps its root unsharded).
   The same hook puts a gradient hook on the module's outputs: in backward it fires before the
   module's backward runs and gathers b again, with the ``prefetch`` buckets before it.
4. The first hook of a backward agrees with the other ranks on who used which parameter
   (commlab/sharded/ordering.py): used nowhere, no gradient; used on some ranks only, a RuntimeError
   on every rank. A post-accumulate-grad hook on each parameter copies its gradient into b's flat
   gradient buffer (pre-divided by the data-parallel size, as torch's DDP) and drops the
   parameter's own; the last one launches b's reduction once every later bucket's has launched
   (descending order), overlapping the rest of backward: an all-reduce (stage 1, which keeps the
   full reduced gradient as the parameters' .grad) or a reduce-scatter into a new shard (stages 2-3,
   which then drop the full buffer). Stage 3 frees b's gathered parameters here. With replicas (HSDP), the result is
   then all-reduced across them (commlab/sharded/hybrid.py). (Steps 4-5: backward.py.)
5. End of backward (a callback queued on the autograd engine, as DDP's reducer does): wait for
   every reduction, then give each DTensor parameter its gradient (this rank's rows, a view into
   the reduced buffer; accumulated if present; none for a parameter no rank used).
6. The user's optimizer steps the shards. Stages 1-2: a step post-hook of an optimizer that holds
   every shard queues every bucket's all-gather and launches the first ``1 + prefetch`` of them,
   so that they overlap whatever the training loop does before the next forward (zero_grad, the
   next batch); waiting for one (step 2) launches the next (a window: each holds a rank-major copy
   of its bucket until its copy-out). A shard written in place outside the optimizer (an init
   after wrapping, a clamp after the step, an EMA swap) moves its DTensor's version counter: the
   next forward gathers it again, and a gather whose rows moved since it sent them is sent again
   (every rank writes its own rows, so every rank sees it). Stage 3 gathers here nothing.

Inside ``no_sync()`` step 4 only counts: gradients accumulate, full size, in the module's
parameters' .grad (in the reduction's dtype where mixed precision computes in another), and the
next synchronised backward reduces the sum.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from commlab.sharded import ordering
from commlab.sharded.backward import BackwardPass
from commlab.sharded.flat_bucket import FlatBucket
from commlab.sharded.timing import Recorder


class ShardedEngine(BackwardPass):
    """The hooks and the state of the iteration in progress (this module's docstring; its backward
    half in commlab/sharded/backward.py)."""

    def __init__(
        self,
        root: nn.Module,
        buckets: list[FlatBucket],
        owners: list[list[nn.Module]],
        stage: int,
        prefetch: int,
        reshard_after_forward: bool,
        names: list[list[str]],
        control,
    ):
        self.buckets, self.stage, self.prefetch = buckets, stage, prefetch
        # Of each trained bucket's parameters, buckets in order (frozen buckets have no gradients)
        self.names = [n for b, ns in zip(buckets, names) if b.trains for n in ns]
        self.slots = [(b, s) for b in buckets if b.trains for s in range(len(b.params))]
        self.accumulators = [ordering.accumulator(b.params[s]) for b, s in self.slots]
        self.control, self.world = control, ordering.data_parallel_size(control)  # the agreements' groups
        self.planned = False  # this backward's usage agreed (ordering.py)
        self.next_reduce = len(buckets) - 1  # the highest bucket whose reduction has not launched
        self.reduced: set[int] = set()  # buckets some rank has a gradient of, in this backward
        self.arrived: set[tuple[int, int]] = set()  # (bucket, slot) settled in this backward
        self.ready_at: dict[int, float] = {}
        self.forward_next = 0  # stage 3: buckets below were gathered (or launched) in this forward
        self.recorder = Recorder()
        self.sync = True
        self.stale = False  # stages 1-2: the shards may have been stepped since the last gather
        self.synced_grads = False  # stage 1: a synchronised backward's full gradients are held
        self.gathers: dict[int, tuple] = {}  # bucket -> (work, timing entry) in flight
        self.queued: list[int] = []  # stages 1-2: all-gathers waiting for the window (step 6)
        self.reductions: list[tuple] = []  # (bucket, work, timing entry)
        self.callback_queued = False
        self.backward_done: set[int] = set()
        self.backward_users: dict[int, int] = {}  # stage 3, frozen bucket -> module backwards still to run
        self.peak_gathered = self.gathered_bytes()
        self.last_peak_gathered = self.peak_gathered
        self.reshard = [
            stage == 3 and reshard_after_forward and not any(m is root for m in owners[b]) for b in range(len(buckets))
        ]
        self.owner_ids = [{id(m) for m in owners[b]} for b in range(len(buckets))]
        self.forward_pending: dict[int, set[int]] = {}
        uses: dict[int, tuple[nn.Module, list[int]]] = {}
        for b, modules in enumerate(owners):
            for m in modules:
                uses.setdefault(id(m), (m, []))[1].append(b)
        self.handles = []
        for m, bs in uses.values():
            self.handles.append(m.register_forward_pre_hook(self._forward_pre_hook(bs)))
            self.handles.append(m.register_forward_hook(self._forward_hook(id(m), bs)))
        for bucket in (b for b in buckets if b.trains):
            for slot, p in enumerate(bucket.params):
                self.handles.append(p.register_post_accumulate_grad_hook(self._grad_hook(bucket, slot)))

    # --- memory accounting ---------------------------------------------------------------
    def gathered_bytes(self) -> int:
        return sum(b.full_nbytes for b in self.buckets if b.gathered)

    def _count(self) -> None:
        self.peak_gathered = max(self.peak_gathered, self.gathered_bytes())

    # --- gathering ---------------------------------------------------------------------------
    def _launch_gather(self, b: int) -> None:
        if b in self.gathers:
            return
        bucket = self.buckets[b]
        entry = self.recorder.launched(b, "all_gather", bucket.full_nbytes)
        self.gathers[b] = (bucket.launch_gather(), entry)
        self._count()

    def _wait_gather(self, b: int, again: bool = True) -> None:
        while b in self.queued:  # stages 1-2: needed before its turn; the queue's order kept (ordering.py)
            self._launch_gather(self.queued.pop(0))
        if b in self.gathers:
            work, entry = self.gathers.pop(b)
            self.recorder.wait(work, entry)
            if not self.buckets[b].finish_gather():
                # Stages 1-2: rows written after they were sent (a clamp after the step): send
                # them again (every rank wrote its own), or leave it to the next forward.
                if again:
                    self._launch_gather(b)
                    self._wait_gather(b)
                else:
                    self.stale = True
        self._pump()

    def _pump(self) -> None:
        """Stages 1-2: launch queued all-gathers while fewer than ``1 + prefetch`` are in flight
        (each holds a rank-major copy of its bucket until its copy-out: all at once would hold a
        second copy of the model)."""
        while self.queued and len(self.gathers) < 1 + self.prefetch:
            self._launch_gather(self.queued.pop(0))

    def _gather_stage3(self, b: int, window: Sequence[int]) -> None:
        """Launch b and the buckets of ``window`` (prefetch) that hold no gathered values, wait b."""
        for j in (b, *window):
            if not self.buckets[j].gathered and j not in self.backward_done:
                self._launch_gather(j)
        self._wait_gather(b)

    def _gather_forward(self, b: int) -> None:
        """Stage 3 in forward: launch, in ascending order, every bucket up to b's ``prefetch`` window
        not gathered in this forward (a bucket a skipped module holds too: the others gather it), or
        b alone if it was freed since (a module run again); wait b."""
        last = min(b + self.prefetch, len(self.buckets) - 1)
        for j in range(self.forward_next, last + 1):
            if not self.buckets[j].gathered:
                self._launch_gather(j)
        self.forward_next = max(self.forward_next, last + 1)
        if not self.buckets[b].gathered:
            self._launch_gather(b)
        self._wait_gather(b)

    def free(self, bs: Sequence[int]) -> None:
        for b in bs:
            if b in self.gathers:  # prefetched for a module that did not run (a unit called on its own)
                self._wait_gather(b)
            if self.buckets[b].gathered:
                self.buckets[b].free()

    # --- forward ---------------------------------------------------------------------------
    def before_forward(self) -> None:
        if self.synced_grads and self.stage == 1:
            for bucket in self.buckets:
                bucket.drop_full_gradients()
        self.synced_grads = False
        # Gathers launched after the optimizer step belong to this iteration (their stamps precede it).
        self.recorder.start(carry=[entry for _, entry in self.gathers.values()])
        self.peak_gathered = self.gathered_bytes()
        if any(bucket.edited() for bucket in self.buckets if bucket.index not in self.gathers):
            self.stale = True  # stages 1-2: rows written outside the optimizer (an init, a clamp)
        self._refresh()
        self.forward_pending = {b: set(self.owner_ids[b]) for b in range(len(self.buckets)) if self.reshard[b]}
        self.forward_next = 0

    def after_step(self) -> None:
        """Stages 1-2, an optimizer holding every shard has stepped: gather the new values now."""
        if self.stage < 3:
            self.settle()  # a gather still in flight sent the values before this step
            self.stale = True
            self._refresh()

    def settle(self, drain: bool = False) -> None:
        """Wait for every all-gather in flight (before anything writes the gathered buffers);
        with ``drain``, also run the queued ones (stages 1-2: every bucket current)."""
        if drain:
            while self.gathers or self.queued:
                self._wait_gather(next(iter(self.gathers)) if self.gathers else self.queued[0])
            return
        queued, self.queued = self.queued, []  # waiting must not launch more
        for b in list(self.gathers):
            self._wait_gather(b, again=False)
        self.queued = queued

    def _refresh(self) -> None:
        """Stages 1-2 after a step: launch every bucket's all-gather (each module waits for its own)."""
        if self.stage < 3 and self.stale:
            self.stale = False
            self.queued = [b for b in range(len(self.buckets)) if b not in self.gathers]
            self._pump()

    def after_forward(self) -> None:
        self.recorder.forward_end = time.perf_counter()
        if self.stage == 3:  # the rest in order: a module skipped here may have run elsewhere
            for j in range(self.forward_next, len(self.buckets)):
                if not self.buckets[j].gathered:
                    self._launch_gather(j)
            self.forward_next = len(self.buckets)
        self.settle(drain=True)  # a bucket no module waited for is current too
        if self.stage == 3:
            # No backward follows: nothing stays gathered. Else every resharded bucket goes, also one
            # whose modules did not all run, so that what backward gathers again is every rank's.
            self.free([b for b in range(len(self.buckets)) if self.reshard[b] or not torch.is_grad_enabled()])

    def _forward_pre_hook(self, bs: list[int]):
        frozen = [b for b in bs if not self.buckets[b].trains]

        def hook(module, args):
            for b in bs:
                if self.stage == 3:
                    self._gather_forward(b)
                else:
                    self._refresh()  # the module called without the wrapper still gets fresh values
                    self._wait_gather(b)
            if frozen and torch.is_grad_enabled():
                return self._free_after_backward(frozen, args)
            return None

        return hook

    def _forward_hook(self, module_id: int, bs: list[int]):
        def hook(module, args, output):
            if self.stage != 3:
                return
            for b in bs:
                pending = self.forward_pending.get(b)
                if pending is not None:
                    pending.discard(module_id)
                    if not pending:
                        del self.forward_pending[b]
                        self.free([b])
            if torch.is_grad_enabled():
                for t in tree_flatten(output)[0]:
                    if isinstance(t, torch.Tensor) and t.requires_grad:
                        t.register_hook(self._pre_backward_hook(bs))

        return hook


def gather_after_step_hook(owner_ref, shards: set[int]):
    """An optimizer step post-hook (global, torch.optim.optimizer.register_optimizer_step_post_hook)
    that calls ``after_step`` of the wrapper ``owner_ref`` (a weak reference) when the optimizer
    holds every one of its ``shards`` (ids); a partial optimizer leaves the gather to the forward,
    since another may still step the other shards."""

    def hook(optimizer: torch.optim.Optimizer, args, kwargs) -> None:
        owner = owner_ref()
        if owner is not None and shards <= {id(p) for group in optimizer.param_groups for p in group["params"]}:
            owner._engine.after_step()

    return hook
