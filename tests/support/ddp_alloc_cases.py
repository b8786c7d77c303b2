"""Rank-side code of tests/ddp/test_alloc.py: what a steady-state DDP iteration allocates.

An allocation is counted from the profiler's memory events (``profile_memory=True``), which on
CPU record every allocation made by the thread running the profiler; the reducer's hooks, the
comm hooks and the end-of-backward write-back all run on that thread (autograd runs a CPU
backward on the caller's thread). Collectives that commlab runs on its worker thread are
checked by running them synchronously (``async_op=False`` runs them on the caller's thread).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as TorchDDP
from torch.profiler import ProfilerActivity, profile

import commlab
from commlab import collectives
from commlab.models import mlp

WARMUP, MEASURED = 3, 4
HOOKS = {None: None, "allreduce": default_hooks.allreduce_hook, "fp16": default_hooks.fp16_compress_hook}


def _big_allocations(prof, threshold: int) -> list[int]:
    """Sizes of the allocations above ``threshold`` bytes: the raw memory records (the profiler's
    table folds the ones made inside an op into that op's total, net of what it freed)."""
    records = prof.profiler.kineto_results.events()
    return [e.nbytes() for e in records if e.name() == "[memory]" and e.nbytes() > threshold]


def _model() -> nn.Module:
    torch.manual_seed(0)
    return mlp(6, 128, in_features=128, classes=8)  # 64 KiB weights; 0.25 MB buckets hold 3-4


def _step(ddp, opt, set_to_none: bool, step: int) -> None:
    g = torch.Generator().manual_seed(100 * dist.get_rank() + step)
    x, y = torch.randn(16, 128, generator=g), torch.randint(0, 8, (16,), generator=g)
    opt.zero_grad(set_to_none=set_to_none)
    nn.functional.cross_entropy(ddp(x), y).backward()
    opt.step()


def ddp_iteration(impl: str, set_to_none: bool, as_view: bool, algorithm: str, hook: str | None) -> dict:
    """Steady-state iterations of one DDP: big allocations per iteration and pointer stability."""
    if impl == "commlab":
        ddp = commlab.DistributedDataParallel(
            _model(), bucket_cap_mb=0.25, gradient_as_bucket_view=as_view, algorithm=algorithm
        )
        buffers = lambda: [b.buffer.data_ptr() for b in ddp.reducer.buckets]  # noqa: E731
    else:
        ddp = TorchDDP(_model(), bucket_cap_mb=0.25, gradient_as_bucket_view=as_view)
        buffers = list  # torch does not expose its bucket buffers
    if HOOKS[hook] is not None:
        ddp.register_comm_hook(None, HOOKS[hook])
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    for step in range(WARMUP):  # the buckets are rebuilt after the first iteration
        _step(ddp, opt, set_to_none, step)
    # Bigger than any one gradient, smaller than any bucket: only something bucket-sized counts.
    threshold = max(p.numel() * p.element_size() for p in ddp.parameters())
    pointers = []
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        for step in range(MEASURED):
            _step(ddp, opt, set_to_none, WARMUP + step)
            pointers.append((buffers(), [p.grad.data_ptr() for p in ddp.parameters()]))
    sizes = list(ddp.bucket_sizes) if impl == "commlab" else []
    return {"big": _big_allocations(prof, threshold), "pointers": pointers, "threshold": threshold, "sizes": sizes}


def collective_calls(algorithm: str, numel: int = 3 << 20) -> dict:
    """Big allocations in repeated synchronous all-reduces of the same tensor (after a first call)."""
    t = torch.ones(numel)
    collectives.all_reduce(t, "sum", algorithm=algorithm)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        for _ in range(3):
            collectives.all_reduce(t, "sum", algorithm=algorithm)
    return {"big": _big_allocations(prof, 1 << 16), "correct": bool((t == dist.get_world_size() ** 4).all())}


def run() -> dict:
    out = {}
    for impl in ("commlab", "torch"):
        for set_to_none in (True, False):
            for as_view in (True, False):
                key = (impl, set_to_none, as_view, "native", None)
                out[key] = ddp_iteration(*key)
        for hook in ("allreduce", "fp16"):
            for as_view in (True, False):
                key = (impl, True, as_view, "native", hook)
                out[key] = ddp_iteration(*key)
    for set_to_none in (True, False):
        for as_view in (True, False):
            key = ("commlab", set_to_none, as_view, "ring", None)
            out[key] = ddp_iteration(*key)
    for algorithm in collectives.algorithm_names():
        out["collective", algorithm] = collective_calls(algorithm)
    return out
