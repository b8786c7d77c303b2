"""Sparse gradients (nn.Embedding / nn.EmbeddingBag with sparse=True), each reduced on its own.

torch gives every parameter that expects a sparse gradient a bucket of its own
(``compute_bucket_assignment_by_size``) and all-reduces the sparse tensor itself, divided by
the world size first unless a comm hook owns the bucket (reducer.cpp,
``mark_variable_ready_sparse``). commlab does the same beside its dense buckets: a sparse
gradient's all-reduce (or the comm hook) starts from its hook, on the native backend --
commlab's ring/tree/halving-doubling reduce flat dense buffers, so they fall back to native for
these, and ``fallback`` says so (recorded on the DDP as ``sparse_fallback``). Each rank issues
these in autograd order, which is the same on every rank, on the group's one ordered path.

What torch does when a sparse parameter gets no gradient, kept here (tried on torch 2.13):

- its hook runs with an undefined gradient, or, with ``find_unused_parameters`` or
  ``static_graph``, the parameter is unused: "Expected sparse gradient to be defined." from
  backward (at the start of backward in the dynamic mode, at its end in the first static one);
- otherwise its bucket never completes and the next forward raises "Expected to have finished
  reduction in the prior iteration", naming it (``unfinished`` here).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from commlab import collectives
from commlab.ddp.graph import grad_accumulators, unreached, weak_hook

UNDEFINED = "Expected sparse gradient to be defined."  # torch's REDUCER_CHECK message


def sparse_parameters(module: nn.Module) -> set[int]:
    """ids of the parameters that will get sparse gradients (torch's produces_sparse_gradient)."""
    return {
        id(p)
        for m in module.modules()
        if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.sparse
        for p in m.parameters(recurse=False)
    }


def sparse_reducer(params, names, dense: list[int], group, algorithm: str) -> SparseReducer | None:
    """The SparseReducer of the parameters not in ``dense`` (indices), or None if there are none."""
    dense_set = set(dense)
    sparse = [i for i in range(len(params)) if i not in dense_set]
    if not sparse:
        return None
    return SparseReducer([params[i] for i in sparse], [names[i] for i in sparse], group=group, algorithm=algorithm)


def start_all_reduce(grad: torch.Tensor, group) -> torch.futures.Future:
    """Start the native all-reduce of a sparse gradient in the group's order, without waiting;
    the future yields a list holding the reduced gradient.

    Nothing queued on the group's worker (DDP on ``native``): issue it now, async, as the dense
    buckets are. A p2p algorithm's dense buckets queued there: queue behind them, so the hook
    returns at once and backward goes on (issuing it on this thread would first wait for every
    bucket queued before it to finish)."""
    if not collectives.group_busy(group):
        return collectives.run_ordered(group, lambda: dist.all_reduce(grad, group=group, async_op=True)).get_future()

    def reduce() -> list[torch.Tensor]:
        work = dist.all_reduce(grad, group=group, async_op=True)
        work.wait()
        return work.result()  # a sparse result need not be written back into ``grad`` (as the future's)

    return collectives.run_async(group, grad.device, reduce)


class SparseGradBucket:
    """A sparse parameter's bucket as a comm hook sees it (torch's GradBucket of a sparse
    bucket: ``buffer()`` is the un-divided sparse gradient, ``gradients()`` is empty)."""

    def __init__(self, index: int, param: torch.Tensor, grad: torch.Tensor, is_last: bool = False):
        self._index, self._param, self._buffer, self._is_last = index, param, grad, is_last

    def index(self) -> int:
        return self._index

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def set_buffer(self, buffer: torch.Tensor) -> None:
        self._buffer = buffer

    def gradients(self) -> list[torch.Tensor]:
        return []

    def parameters(self) -> list[torch.Tensor]:
        return [self._param]

    def is_last(self) -> bool:
        return self._is_last


class SparseReducer:
    """Hooks, in-flight all-reduces and the end-of-backward write-back of sparse gradients.

    The dense Reducer drives it: ``on_first_hook`` from each of its hooks and
    ``finish`` first thing at its end of backward.
    """

    def __init__(self, params: Sequence[torch.Tensor], names: Sequence[str], *, group, algorithm: str):
        self.params, self.names, self.group = list(params), list(names), group
        self.world_size = dist.get_world_size(group)
        self.fallback = (
            None
            if algorithm == "native"
            else f"sparse gradients of {self.names} use the native backend's sparse all-reduce: "
            f"{algorithm!r} reduces dense buffers"
        )
        self.comm_hook: Callable | None = None
        self.comm_state: Any = None
        self.first_index = 0  # a hook's bucket index: numbered after the dense buckets
        self.start_backward: Callable[[], None] = lambda: None  # the dense reducer's, set by the DDP
        self.expect_hooks = False
        self.unfinished: list[str] = []
        self._unreachable: list[int] = []
        self._in_flight: dict[int, torch.futures.Future] = {}
        self._timeout = collectives.group_timeout(group)
        self._accumulators = grad_accumulators(self.params)
        self._accumulator_index = {acc: i for i, acc in enumerate(self._accumulators)}
        me = weakref.ref(self)
        self._hooks = [p.register_post_accumulate_grad_hook(weak_hook(me, i)) for i, p in enumerate(self.params)]

    def __del__(self) -> None:
        for handle in getattr(self, "_hooks", ()):
            handle.remove()

    def prepare_for_backward(self, reached: set | None) -> None:
        """After a synchronised forward; ``reached``: the dense reducer's walk of the graph
        (:func:`graph.reachable`) when the dynamic mode searches it, else None."""
        self.expect_hooks = True
        self._in_flight = {}
        self._unreachable = unreached(reached, self._accumulator_index) if reached is not None else []

    def on_first_hook(self) -> None:
        """Any parameter's hook; the first of a backward raises if the graph search found a sparse
        parameter unused: torch marks unused ones ready in its first autograd hook."""
        if self._unreachable and self.expect_hooks:
            raise RuntimeError(UNDEFINED)

    def _on_gradient(self, index: int, param: torch.Tensor) -> None:
        if not self.expect_hooks:
            return
        self.on_first_hook()
        self.start_backward()
        if param.grad is None:
            raise RuntimeError(UNDEFINED)
        with torch.no_grad():
            if self.comm_hook is not None:
                bucket = SparseGradBucket(self.first_index + index, param, param.grad)
                future = self.comm_hook(self.comm_state, bucket)
            else:
                # Divided first, in place, and reduced itself, as torch (mark_variable_ready_sparse:
                # the gradient itself is the bucket), so an unfinished iteration leaves the same.
                grad = param.grad.div_(self.world_size)
                future = start_all_reduce(grad, self.group)
        self._in_flight[index] = future

    def finish(self, tracking: bool) -> bool:
        """End of backward, before the dense buckets are written back; ``tracking``: this
        iteration learns which parameters are used (then torch marks a missing one ready and
        fails). Otherwise a missing one leaves its bucket unfinished, as in torch: False, nothing
        written back, and ``unfinished`` names it for the next forward's error."""
        self.expect_hooks = False
        missing = [i for i in range(len(self.params)) if i not in self._in_flight]
        if missing and tracking:
            raise RuntimeError(UNDEFINED)
        results = {
            i: collectives.wait_future(future, 2 * self._timeout, f"sparse bucket of {self.names[i]}")
            for i, future in self._in_flight.items()
        }
        self._in_flight = {}
        self.unfinished = [self.names[i] for i in missing]
        if missing:
            return False
        for index, result in results.items():
            self.params[index].grad = result[0] if isinstance(result, list) else result
        return True
