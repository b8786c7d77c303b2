"""The reducer: gradient hooks fill buckets, full buckets are all-reduced while backward goes on.

The life cycle of one synchronised iteration (the numbers are referred to below; the prose is in
docs/design.md, and the C++ original is torch/csrc/distributed/c10d/reducer.cpp):

1. ``prepare_for_backward`` after forward: every bucket expects all of its gradients again; with
   ``find_unused_parameters`` the autograd graph is searched for parameters it cannot reach.
2. A hook after each parameter's gradient accumulation copies the gradient into its bucket's
   buffer (divided by the world size on the way, as torch does, unless a comm hook owns that).
3. When a bucket's last gradient arrives, buckets are launched strictly in order: bucket k starts
   only after bucket k-1, so every rank issues the same collectives in the same order.
4. The end of backward (an autograd engine callback queued by the first hook) launches what is
   left, waits for every bucket and writes the averaged values back into ``.grad``.
5. After the first synchronised iteration the buckets are rebuilt once from the order in which
   gradients became ready (rank 0's order, broadcast), with the small first bucket.
"""

from __future__ import annotations

import weakref
from collections import deque
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch.autograd import Variable

from commlab import collectives
from commlab.ddp.assignment import (
    buckets_from_ready_order,
    initial_buckets,
    initial_size_limits,
    will_rebuild,
)
from commlab.ddp.bucket import Bucket, GradBucket
from commlab.ddp.graph import grad_accumulators
from commlab.ddp.timing import MAX_ITERATIONS, IterationTiming, RawIteration, make_clock, resolve
from commlab.ddp.unused import UnusedParameters


class Reducer:
    """Buckets, gradient hooks and the per-iteration state of gradient synchronisation."""

    def __init__(
        self,
        params: Sequence[torch.Tensor],
        names: Sequence[str],
        *,
        group,
        comm_groups: Sequence,
        algorithm: str,
        overlap: bool,
        find_unused_parameters: bool,
        gradient_as_bucket_view: bool,
        static_graph: bool,
        first_cap: int,
        cap: int,
    ):
        self.params = list(params)
        self.names = list(names)
        self.group = group
        self.comm_groups = list(comm_groups)
        self.world_size = dist.get_world_size(group)
        self.algorithm = algorithm
        self.overlap = overlap
        self.find_unused = find_unused_parameters
        self.as_view = gradient_as_bucket_view
        self.first_cap, self.cap = first_cap, cap
        self.device = self.params[0].device
        self.clock = make_clock(self.device)
        self.comm_hook: Callable | None = None
        self.comm_state: Any = None
        self.sparse: Any = None  # the SparseReducer beside this one (commlab/ddp/sparse.py), if any
        self.rebuild_pending = will_rebuild(find_unused_parameters, static_graph)
        limits = initial_size_limits(first_cap, cap, find_unused_parameters, static_graph)
        self._install(initial_buckets(self.params, limits))
        self._accumulators = grad_accumulators(self.params)  # held, as torch's Reducer does
        self._accumulator_index = {acc: i for i, acc in enumerate(self._accumulators)}
        # The hooks reach the reducer through a weak reference, so a dropped DDP is freed (and its
        # hooks removed in __del__) even though the parameters live on; torch's Reducer likewise
        # removes its hooks when destroyed.
        me = weakref.ref(self)
        self._hooks = [p.register_post_accumulate_grad_hook(_hook(me, i)) for i, p in enumerate(self.params)]
        self.expect_hooks = False
        self._started = False
        self._next_launch = 0
        self._marked = bytearray(len(self.params))
        self._unused: list[int] = []
        # -- unused parameters (commlab/ddp/unused.py) --
        self.usage = UnusedParameters(names, find_unused_parameters=find_unused_parameters, static_graph=static_graph)
        self._locally_unused: list[int] = []
        self._ready_order: list[int] = []
        self._start: Any = None
        self._forward_end: Any = None
        # Bounded (timing.MAX_ITERATIONS): a long run does not grow without limit.
        self._raw: deque[RawIteration] = deque(maxlen=MAX_ITERATIONS)
        self._timings: deque[IterationTiming] = deque(maxlen=MAX_ITERATIONS)
        self._timeout = collectives.group_timeout(group)

    def __del__(self) -> None:
        for handle in getattr(self, "_hooks", ()):
            handle.remove()

    # -- buckets ---------------------------------------------------------------------------
    def _install(self, bucket_indices: list[list[int]]) -> None:
        self.buckets = [Bucket(k, idx, [self.params[i] for i in idx]) for k, idx in enumerate(bucket_indices)]
        self.locate: list[tuple[Bucket, int]] = [None] * len(self.params)  # type: ignore[list-item]
        for bucket in self.buckets:
            for slot, i in enumerate(bucket.param_indices):
                self.locate[i] = (bucket, slot)
        if self.as_view:
            # As torch's initialize_bucket_views: existing gradients move into the new buffers.
            with torch.no_grad():
                for bucket in self.buckets:
                    for p, view in zip(bucket.params, bucket.views):
                        if p.grad is not None:
                            view.copy_(p.grad)
                            p.grad = view

    def maybe_rebuild(self) -> bool:
        """Step 5; collective over the group, so every rank calls it at the same forward."""
        if not self.rebuild_pending or len(self._ready_order) != len(self.params):
            return False
        order = torch.tensor(self._ready_order, dtype=torch.int64, device=self.device)
        # torch syncs the rebuilt indices from rank 0 (Reducer::sync_bucket_indices).
        src = dist.get_global_rank(self.group, 0)
        collectives.run_ordered(self.group, lambda: dist.broadcast(order, src, group=self.group))
        self._install(buckets_from_ready_order(self.params, order.tolist(), self.first_cap, self.cap))
        self.rebuild_pending = False
        self._ready_order = []
        return True

    # -- one iteration -----------------------------------------------------------------------
    def start_iteration(self) -> None:
        self._start = self.clock.stamp()

    def prepare_for_backward(self, outputs: Sequence[torch.Tensor]) -> None:
        """Step 1."""
        self.expect_hooks = True
        self._started = False
        self._next_launch = 0
        self._marked = bytearray(len(self.params))
        for bucket in self.buckets:
            bucket.reset()
        if self.rebuild_pending:
            self._ready_order = []
        self._unused = self.usage.unused_at_start(outputs, self._accumulator_index)
        self._locally_unused = list(self._unused)
        self._queued: dict[int, Any] = {}
        self._forward_end = self.clock.stamp()

    def on_backward_start(self) -> None:
        """The first hook (or the output sink) of a synchronised backward."""
        if self._started or not self.expect_hooks:
            return
        self._started = True
        Variable._execution_engine.queue_callback(self._finalize)
        with torch.no_grad():
            for i in self._unused:  # they will get no hook; their bucket must still fill up
                self._mark_ready(i)

    def _on_gradient(self, index: int, param: torch.Tensor) -> None:
        """Step 2 (the post-accumulate-grad hook of parameter ``index``).

        This runs once per parameter per backward, so it stays lean: no context managers unless
        backward builds a graph (create_graph=True), where the copies must not be recorded.
        """
        if not self.expect_hooks:  # no_sync, or a backward that did not go through forward
            return
        if self.sparse is not None:  # may raise, as torch does at its first hook
            self.sparse.on_first_hook()
        if not self._started:
            self.on_backward_start()
        if self.rebuild_pending and not self.usage.static_first:  # torch records no order then
            self._ready_order.append(index)
        if param.grad is None and self.usage.tracking:  # undefined gradient: locally unused (torch)
            self._locally_unused.append(index)
        if torch.is_grad_enabled():
            with torch.no_grad():
                self._mark_ready(index)
        else:
            self._mark_ready(index)

    def _mark_ready(self, index: int) -> None:
        if self._marked[index]:
            raise RuntimeError(
                f"parameter {self.names[index]!r} was marked ready twice in one backward "
                "(reentrant backward or a parameter used by two DDP instances is not supported)"
            )
        self._marked[index] = 1
        bucket, slot = self.locate[index]
        self._fill(bucket, slot)
        bucket.pending -= 1
        if bucket.pending == 0:
            bucket.ready_at = self.clock.stamp()
            if self.overlap:
                self._launch_in_order()

    def _fill(self, bucket: Bucket, slot: int) -> None:
        p, view = bucket.params[slot], bucket.views[slot]
        grad = p.grad
        divide = self.comm_hook is None
        if grad is None:  # locally unused: contributes zeros (torch's mark_variable_ready_dense)
            view.zero_()
        elif grad.data_ptr() == view.data_ptr():  # already a view into the bucket
            if divide:
                view.div_(self.world_size)
        else:
            if divide:
                torch.mul(grad, 1.0 / self.world_size, out=view)  # divide while copying: one pass
            else:
                view.copy_(grad)
            if self.as_view:
                p.grad = view

    def _launch_in_order(self) -> None:
        """Step 3."""
        while self._next_launch < len(self.buckets) and self.buckets[self._next_launch].pending == 0:
            self._launch(self.buckets[self._next_launch])
            self._next_launch += 1

    def _launch(self, bucket: Bucket) -> None:
        bucket.launched_at = self.clock.stamp()
        if self.comm_hook is not None:
            is_last = bucket.position == len(self.buckets) - 1
            future = self.comm_hook(self.comm_state, GradBucket(bucket, is_last))
        else:
            group = self.comm_groups[bucket.position % len(self.comm_groups)]
            work = collectives.all_reduce(bucket.buffer, "sum", algorithm=self.algorithm, group=group, async_op=True)
            future = work.get_future()
        # "done" is stamped when the collective completes (on the thread completing it), not when
        # the end of backward gets round to waiting; waiting on the chained future also makes the
        # stamp visible before the iteration is recorded.
        handle = work if self.comm_hook is None else None
        bucket.future = future.then(partial(self._done, bucket, handle))

    def _done(self, bucket: Bucket, handle: Any, future: torch.futures.Future) -> Any:
        value = future.value()  # re-raises a failed collective into the chained future
        bucket.done_at = self.clock.stamp()
        self._queued[bucket.position] = bucket.launched_at  # handed over (timing.py: queued)
        if handle is not None and handle.launched is not None:  # when it really started (timing.py)
            bucket.launched_at = handle.launched
        return value

    def _wait(self, bucket: Bucket) -> torch.Tensor:
        """Wait for a bucket (bounded); a failure names the bucket and the algorithm on every rank."""
        how = "its comm hook" if self.comm_hook is not None else f"all-reduce algorithm {self.algorithm!r}"
        try:
            return collectives.wait_future(bucket.future, 2 * self._timeout, f"bucket {bucket.position}")
        except Exception as exc:
            raise RuntimeError(
                f"DistributedDataParallel: bucket {bucket.position} of {len(self.buckets)} "
                f"({bucket.nbytes} bytes, {len(bucket.params)} parameters) failed on rank "
                f"{dist.get_rank(self.group)} in {how}: {type(exc).__name__}: {exc}"
            ) from exc

    def _finalize(self) -> None:
        """Step 4: runs on the autograd engine once the whole backward graph has executed."""
        self._backward_end = self.clock.stamp()
        self._write_back_spans: list[tuple[Any, Any]] = []
        self._unused_span: tuple[Any, Any] | None = None
        self.expect_hooks = False
        if self.sparse is not None and not self.sparse.finish(self.usage.tracking):
            for bucket in self.buckets[: self._next_launch]:  # torch does not finalize: no write-back
                self._wait(bucket)
            return
        if 0 in self._marked and not self._fill_missing():
            return
        if self.rebuild_pending:
            self._ready_order.extend(self.usage.rebuild_tail())
        self._launch_in_order()  # everything, when overlap=False
        tracked = self.usage.tracking
        globally_unused = self.usage.end_of_backward(self._locally_unused, self.group, self.device, self.clock.stamp)
        if tracked:  # the unused-parameter all-reduce ran: its own timing column
            self._unused_span = self.usage.span
        with torch.no_grad():
            for bucket in self.buckets:
                result = self._wait(bucket)
                start = self.clock.stamp()
                if self.comm_hook is not None and result.data_ptr() != bucket.buffer.data_ptr():
                    bucket.buffer.copy_(result.view(-1))
                self._write_back(bucket, globally_unused)
                self._write_back_spans.append((start, self.clock.stamp()))
        self._record()

    def _fill_missing(self) -> bool:
        """Parameters no hook reached by the end of backward. Where this iteration tracks usage they
        are locally unused (zeros); otherwise, as torch, the launched buckets complete, nothing is
        written back and the next forward raises (UnusedParameters.check_prior_finished)."""
        missing = [i for i in range(len(self.params)) if not self._marked[i]]
        if not self.usage.tracking:
            for bucket in self.buckets[: self._next_launch]:
                self._wait(bucket)
            self.usage.unfinished = missing
            return False
        self._locally_unused.extend(missing)
        self.usage.note_no_hook(missing)
        with torch.no_grad():
            for i in missing:
                self._mark_ready(i)
        return True

    def _write_back(self, bucket: Bucket, globally_unused: list[bool] | None) -> None:
        if globally_unused is None and not self.as_view and all(p.grad is not None for p in bucket.params):
            torch._foreach_copy_([p.grad for p in bucket.params], bucket.views)  # one op per bucket
            return
        for i, p, view in zip(bucket.param_indices, bucket.params, bucket.views):
            if globally_unused is not None and globally_unused[i]:
                continue  # as torch: a parameter no rank used keeps its .grad untouched
            if self.as_view:
                if p.grad is None or p.grad.data_ptr() != view.data_ptr():
                    p.grad = view
            elif p.grad is None:
                p.grad = view.clone()
            else:
                p.grad.copy_(view)

    # -- timings -----------------------------------------------------------------------------
    def _record(self) -> None:
        end = self.clock.stamp()
        buckets = [
            (b.nbytes, len(b.params), b.ready_at, b.launched_at, b.done_at, self._queued[b.position])
            for b in self.buckets
        ]
        self._raw.append(
            RawIteration(self._start, self._forward_end, end, buckets, self._backward_end,
                         self._unused_span, self._write_back_spans)
        )

    @property
    def timings(self) -> list[IterationTiming]:
        # Resolved lazily: on CUDA this waits for the events, which must not happen in backward.
        while self._raw:
            self._timings.append(resolve(self.clock, self._raw.popleft()))
        return list(self._timings)

    def reset_timings(self) -> None:
        self._raw.clear()
        self._timings.clear()


def _hook(reducer: weakref.ref, index: int) -> Callable[[torch.Tensor], None]:
    def hook(param: torch.Tensor) -> None:
        live = reducer()
        if live is not None:
            live._on_gradient(index, param)

    return hook
