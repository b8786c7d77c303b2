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
   gradients became ready (rank 0's order, broadcast): by default with the small first bucket
   (the bucket policy decides both assignments: commlab/ddp/policy.py).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.autograd import Variable

from commlab import collectives
from commlab.ddp.assignment import TensorSpec, will_rebuild
from commlab.ddp.bucket import Bucket
from commlab.ddp.graph import grad_accumulators, reachable, weak_hook
from commlab.ddp import inflight
from commlab.ddp.policy import BucketPolicy, checked
from commlab.ddp.timing import MAX_ITERATIONS, IterationTiming, RawIteration, TimingLog
from commlab.runtime.timer import make_clock
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
        policy: BucketPolicy,
        device: torch.device | None = None,
    ):
        self.params = list(params)
        self.names = list(names)
        self.group = group
        self.comm_groups = list(comm_groups)
        self.world_size = dist.get_world_size(group)
        self.algorithm = algorithm
        self.overlap = overlap
        self.as_view = gradient_as_bucket_view
        self.policy = policy  # commlab/ddp/policy.py: which gradients share a bucket
        self._specs = [TensorSpec.of(p) for p in self.params]
        # ``device`` for a model whose parameters all have sparse gradients (no dense one here)
        self.device = self.params[0].device if self.params else device
        self.clock = make_clock(self.device)
        self.comm_hook: Callable | None = None
        self.comm_state: Any = None
        self.sparse: Any = None  # the SparseReducer beside this one (commlab/ddp/sparse.py), if any
        self.rebuild_pending = will_rebuild(find_unused_parameters, static_graph)
        self._install(checked(policy.initial(self._specs, self.rebuild_pending), len(self.params), policy))
        self._accumulators = grad_accumulators(self.params)  # held, as torch's Reducer does
        self._accumulator_index = {acc: i for i, acc in enumerate(self._accumulators)}
        # The hooks reach the reducer through a weak reference, so a dropped DDP is freed (and its
        # hooks removed in __del__) even though the parameters live on; torch's Reducer likewise
        # removes its hooks when destroyed.
        me = weakref.ref(self)
        self._hooks = [p.register_post_accumulate_grad_hook(weak_hook(me, i)) for i, p in enumerate(self.params)]
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
        self._log = TimingLog(self.clock, MAX_ITERATIONS)
        self._timeout = collectives.group_timeout(group)
        self.grad_order: list[int] | None = None  # hook order, when logging samples this iteration
        self.last_iteration: RawIteration | None = None  # what logging_data.py reads

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
        self._install(checked(self.policy.rebuild(self._specs, order.tolist()), len(self.params), self.policy))
        self.rebuild_pending = False
        self._ready_order = []
        return True

    def complete_ready_order(self) -> None:
        """A joined rank's shadow backward saw no gradient: record every parameter as ready, in
        index order (torch's _push_all_rebuilt_params), so that its pending rebuild still runs."""
        if self.rebuild_pending and len(self._ready_order) != len(self.params):
            self._ready_order = list(range(len(self.params)))

    def set_static_graph(self, find_unused_parameters: bool) -> None:
        """torch's Reducer::set_static_graph before the first iteration: the buckets stay as
        built, the unused-parameter mode becomes static and the rebuild follows its rule."""
        self.usage = UnusedParameters(self.names, find_unused_parameters=find_unused_parameters, static_graph=True)
        self.rebuild_pending = will_rebuild(find_unused_parameters, True)

    # -- one iteration -----------------------------------------------------------------------
    def start_iteration(self) -> None:
        self._start = self.clock.stamp()

    def prepare_for_backward(self, outputs: Sequence[torch.Tensor]) -> set | None:
        """Step 1. Returns the graph walk of the dynamic mode (None in the others), which the
        sparse reducer reuses rather than walking the graph again."""
        self.expect_hooks = True
        self._started = False
        self._next_launch = 0
        self._marked = bytearray(len(self.params))
        for bucket in self.buckets:
            bucket.reset()
        if self.rebuild_pending:
            self._ready_order = []
        reached = reachable(outputs) if self.usage.dynamic else None
        self._unused = self.usage.unused_at_start(reached, self._accumulator_index)
        self._locally_unused = list(self._unused)
        self._queued: dict[int, Any] = {}
        self._forward_end = self.clock.stamp()
        return reached

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
            if self.usage.dynamic and param.grad is not None:  # used: reduced at the next sync (unused.py)
                self.usage.used_unsynced.add(index)
            return
        if self.sparse is not None:  # may raise, as torch does at its first hook
            self.sparse.on_first_hook()
        if not self._started:
            self.on_backward_start()
        if self.grad_order is not None:
            self.grad_order.append(index)
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
        bucket.fill(slot, self.world_size if self.comm_hook is None else None, self.as_view)
        bucket.pending -= 1
        if bucket.pending == 0:
            bucket.ready_at = self.clock.stamp()
            if self.overlap:
                self._launch_in_order()

    def _launch_in_order(self) -> None:
        """Step 3."""
        while self._next_launch < len(self.buckets) and self.buckets[self._next_launch].pending == 0:
            self._launch(self.buckets[self._next_launch])
            self._next_launch += 1

    def _launch(self, bucket: Bucket) -> None:
        inflight.launch(bucket, last=len(self.buckets) - 1, hook=self.comm_hook, state=self.comm_state,
                        groups=self.comm_groups, algorithm=self.algorithm, clock=self.clock, queued=self._queued)

    def _wait(self, bucket: Bucket) -> torch.Tensor:
        return inflight.wait(bucket, buckets=len(self.buckets), timeout=self._timeout, hooked=self.comm_hook is not None,
                             algorithm=self.algorithm, group=self.group)  # fmt: skip

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
                bucket.write_back(globally_unused, self.as_view)
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

    # -- timings -----------------------------------------------------------------------------
    def _record(self) -> None:
        buckets = [
            (b.nbytes, len(b.params), b.ready_at, b.launched_at, b.done_at, self._queued[b.position])
            for b in self.buckets
        ]
        self.last_iteration = RawIteration(self._start, self._forward_end, self.clock.stamp(), buckets,
                                           self._backward_end, self._unused_span, self._write_back_spans)
        self._log.append(self.last_iteration)

    @property
    def timings(self) -> list[IterationTiming]:
        return self._log.resolved()

    def reset_timings(self) -> None:
        self._log.clear()

