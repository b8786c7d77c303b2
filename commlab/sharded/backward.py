"""The backward half of a sharded step (commlab/sharded/engine.py, steps 4-5): the agreement on
used parameters at its first hook, the gradient hooks, reductions in descending bucket order, and
the end of backward. A mixin of ShardedEngine, whose state it reads and writes."""

from __future__ import annotations

import time

import torch
from torch.autograd import Variable
from torch.utils._pytree import tree_flatten, tree_unflatten

from commlab.sharded import ordering
from commlab.sharded.flat_bucket import FlatBucket


class BackwardPass:
    """ShardedEngine's backward methods (state set in ShardedEngine.__init__)."""

    def _begin_backward(self) -> None:
        """The first hook of a backward, before any collective of it: agree on who used which
        parameter (commlab/sharded/ordering.py; not inside ``no_sync()`` at stages 1-2, which
        communicate nothing) and queue the end of backward on the autograd engine, as DDP's reducer."""
        if self.planned:
            return
        self.planned, self.next_reduce = True, len(self.buckets) - 1
        runs = [ordering.will_accumulate(node) for node in self.accumulators]
        # A gradient accumulated in no_sync() is reduced now, also without one in this backward.
        held = [self.sync and not self.synced_grads and b.has_gradient(s) for b, s in self.slots]
        counts = [self.world] * len(self.slots)  # no_sync() at stages 1-2: nothing to agree on
        # stage 3 gathers in backward, also inside no_sync(); one rank has no one to agree with (torch's
        # fully_shard issues no collective at world size 1, and its tests count them)
        if (self.sync or self.stage == 3) and self.world > 1:
            counts = ordering.agree([int(r or h) for r, h in zip(runs, held)], self.control)
        unused, partial = ordering.verdict(counts, self.world)
        if partial:
            self._end_backward()
            for bucket in self.buckets:
                bucket.drop_full_gradients()
            raise RuntimeError(ordering.partial_message([self.names[i] for i in partial],
                                                        [counts[i] for i in partial], self.world))
        self.callback_queued = True
        Variable._execution_engine.queue_callback(self._finalize)
        for i, (bucket, slot) in enumerate(self.slots):
            if counts[i]:
                self.reduced.add(bucket.index)
            if counts[i] == 0 or (held[i] and not runs[i]):
                if self.sync and counts[i] == 0:
                    bucket.no_gradient.add(slot)  # its .grad stays as it is (None), as fully_shard's
                    bucket.add_zero_gradient(slot)  # the other slots' reduction reads every element
                elif self.sync:
                    bucket.add_gradient(slot)
                self.arrived.add((bucket.index, slot))
                bucket.pending -= 1
        self.ready_at = {b.index: time.perf_counter() for b in self.buckets if b.pending == 0}
        self._launch_in_order()

    def _pre_backward_hook(self, bs: list[int]):
        def hook(grad):
            self._begin_backward()
            for b in bs:
                if b not in self.backward_done:
                    self._gather_stage3(b, range(b - 1, max(b - 1 - self.prefetch, -1), -1))
            return None

        return hook

    def _grad_hook(self, bucket: FlatBucket, slot: int):
        def hook(param):
            self._begin_backward()
            if self.sync:
                bucket.add_gradient(slot)
            else:
                bucket.hold_gradient(slot)
            self.arrived.add((bucket.index, slot))
            bucket.pending -= 1
            if bucket.pending == 0:
                self.ready_at[bucket.index] = time.perf_counter()
                self.backward_done.add(bucket.index)
                self._launch_in_order()
                if self.stage == 3 and bucket.gathered:
                    self._wait_gather(bucket.index)  # never free under a gather still writing
                    bucket.free()

        return hook

    def _launch_in_order(self) -> None:
        """Launch the reductions of the ready buckets in descending order (ordering.py); a bucket no
        rank has a gradient of is passed over."""
        launch, self.next_reduce = ordering.in_order(self.next_reduce, [b.pending == 0 for b in self.buckets])
        if not self.sync:
            return
        for b in launch:
            if b not in self.reduced:
                continue
            bucket = self.buckets[b]
            kind = "all_reduce" if self.stage == 1 else "reduce_scatter"
            if self.stage >= 2:
                self._retire_reductions()
            entry = self.recorder.launched(b, kind, bucket.reduce_nbytes, self.ready_at[b])
            self.reductions.append((bucket, bucket.launch_reduction(), entry))

    def _retire_reductions(self) -> None:
        """Stages 2-3, before the next reduce-scatter: wait for the earlier ones and drop their full
        gradient buffers, so that at most one bucket's unsharded gradient is in flight (torch's
        fully_shard does the same with its default reduce_scatter_max_input_buffers=1,
        torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py post_backward); without it a
        rank holds the whole unsharded gradient at the end of backward, as DDP does."""
        kept = []
        for bucket, work, entry in self.reductions:
            self.recorder.wait(work, entry)
            follow = bucket.finish_reduction()
            if follow is not None:  # HSDP: the all-reduce across replicas, waited for on the next call
                kept.append((bucket, follow, follow.entry(self.recorder, bucket.index)))
        self.reductions = kept

    def _end_backward(self) -> None:
        """Every bucket back to its state before a backward (stage 3: nothing gathered)."""
        for bucket in self.buckets:
            bucket.pending = bucket.expected
            bucket.no_gradient = set()
        self.backward_users.clear()
        self.backward_done.clear()
        self.reduced.clear()
        self.arrived.clear()
        self.planned = self.callback_queued = False
        if self.stage == 3:
            self.free(range(len(self.buckets)))

    def _finalize(self) -> None:
        backward_end = time.perf_counter()
        if self.sync:
            # Agreed used, yet no gradient arrived (an accumulator run on an undefined gradient):
            # zeros, so that the sequence of reductions stays every rank's.
            for bucket in self.buckets:
                if bucket.pending:
                    for slot in range(len(bucket.params)):
                        if (bucket.index, slot) not in self.arrived:
                            bucket.add_zero_gradient(slot)
                    bucket.pending = 0
                    self.ready_at[bucket.index] = backward_end
            self._launch_in_order()
        while self.reductions:
            self._retire_reductions()
        self._end_backward()
        self.last_peak_gathered = self.peak_gathered
        if self.sync:
            self.stale = self.stage < 3
            self.synced_grads = True
            self.recorder.end(backward_end)

    def _free_after_backward(self, frozen: list[int], args: tuple) -> tuple | None:
        """Stage 3: no gradient says when a frozen bucket's module is done in backward, so its
        inputs pass through an identity whose backward runs after the module's (fully_shard's
        RegisterPostBackwardFunction, torch/distributed/fsdp/_fully_shard/_fsdp_state.py) and frees
        the bucket once every such backward of it has run; without inputs that need a gradient,
        the end of backward frees it."""
        flat, spec = tree_flatten(args)
        where = [i for i, t in enumerate(flat) if isinstance(t, torch.Tensor) and t.requires_grad]
        if not where:
            return None
        for b in frozen:
            self.backward_users[b] = self.backward_users.get(b, 0) + 1
        outs = _AfterBackward.apply(lambda: self._module_backward_done(frozen), *[flat[i] for i in where])
        for i, t in zip(where, outs):
            flat[i] = t
        return tree_unflatten(flat, spec)

    def _module_backward_done(self, frozen: list[int]) -> None:
        for b in frozen:
            self.backward_users[b] = max(self.backward_users.get(b, 0) - 1, 0)
            if not self.backward_users[b]:
                self.free([b])


class _AfterBackward(torch.autograd.Function):
    """Identity on tensors; its backward calls ``done`` first (see _free_after_backward)."""

    @staticmethod
    def forward(ctx, done, *tensors):
        ctx.done = done
        return tensors

    @staticmethod
    def backward(ctx, *grads):
        ctx.done()
        return (None, *grads)
