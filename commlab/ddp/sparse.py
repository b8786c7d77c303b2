"""Sparse gradients (nn.Embedding / nn.EmbeddingBag with sparse=True), each reduced on its own.

torch gives every parameter that expects a sparse gradient a bucket of its own
(``compute_bucket_assignment_by_size``) and all-reduces the sparse tensor itself, divided by
the world size first (reducer.cpp, ``mark_variable_ready_sparse``). commlab does the same
beside its dense buckets: a sparse gradient is divided and its all-reduce started from its
hook, on the native backend -- commlab's ring/tree/halving-doubling reduce flat dense buffers,
so they fall back to native for these, and ``fallback`` says so (recorded on the DDP as
``sparse_fallback``). Each rank issues these in autograd order, which is the same on every rank.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd import Variable


def sparse_parameters(module: nn.Module) -> set[int]:
    """ids of the parameters that will get sparse gradients (torch's produces_sparse_gradient)."""
    return {
        id(p)
        for m in module.modules()
        if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.sparse
        for p in m.parameters(recurse=False)
    }


class SparseReducer:
    """Hooks, in-flight all-reduces and the end-of-backward write-back of sparse gradients."""

    def __init__(self, params: Sequence[torch.Tensor], names: Sequence[str], *, group, algorithm: str):
        self.params, self.names, self.group = list(params), list(names), group
        self.world_size = dist.get_world_size(group)
        self.fallback = (
            None
            if algorithm == "native"
            else f"sparse gradients of {self.names} use the native backend's sparse all-reduce: "
            f"{algorithm!r} reduces dense buffers"
        )
        self.expect_hooks = False
        self._in_flight: list[tuple[torch.Tensor, torch.futures.Future]] = []
        me = weakref.ref(self)
        self._hooks = [p.register_post_accumulate_grad_hook(_hook(me)) for p in self.params]

    def __del__(self) -> None:
        for handle in getattr(self, "_hooks", ()):
            handle.remove()

    def prepare_for_backward(self) -> None:
        self.expect_hooks = True
        self._in_flight = []

    def _on_gradient(self, param: torch.Tensor) -> None:
        if not self.expect_hooks:
            return
        if not self._in_flight:
            Variable._execution_engine.queue_callback(self._finalize)
        with torch.no_grad():
            grad = param.grad.coalesce() / self.world_size  # divide first, as torch
        work = dist.all_reduce(grad, group=self.group, async_op=True)
        self._in_flight.append((param, work.get_future()))

    def _finalize(self) -> None:
        self.expect_hooks = False
        if len(self._in_flight) != len(self.params):
            raise RuntimeError(
                "DistributedDataParallel: every sparse-gradient parameter must get a gradient in each "
                f"synchronised backward; got {len(self._in_flight)} of {len(self.params)} ({self.names})"
            )
        for param, future in self._in_flight:
            param.grad = future.wait()[0]
        self._in_flight = []


def _hook(reducer: weakref.ref):
    def hook(param: torch.Tensor) -> None:
        live = reducer()
        if live is not None:
            live._on_gradient(param)

    return hook
