"""Rank-side code of the DDP tests: run commlab's DDP and torch's DDP side by side and compare.

Each spawned function runs many configurations in one process group and returns plain data
(max differences, bucket lists, timings) for the parent test to assert on.
"""

from __future__ import annotations

import copy
import gc
import warnings

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import commlab
from commlab.models import TinyTransformer, mlp


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 4)
        self.c.weight = nn.Parameter(self.a.weight[:4].detach().clone())
        self.b.weight = self.a.weight  # shared: one parameter, one gradient accumulator

    def forward(self, x):
        return self.c(torch.relu(self.b(torch.relu(self.a(x)))))


class Branchy(nn.Module):
    """``extra`` is used only on odd ranks; ``dead`` on no rank at all."""

    def __init__(self):
        super().__init__()
        self.trunk, self.extra, self.dead = nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 16)
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        h = torch.relu(self.trunk(x))
        if dist.get_rank() % 2 == 1:
            h = h + self.extra(h)
        return self.head(h)


def bn_model():
    return nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 4))


MODELS = {"mlp": lambda: mlp(3, 32, in_features=16, classes=4), "bn": bn_model, "tied": Tied, "branchy": Branchy}


def _data(step: int, micro: int = 0):
    g = torch.Generator().manual_seed(1000 * dist.get_rank() + 10 * step + micro)
    device = commlab.Runtime.current().device  # cpu on gloo, this rank's GPU on nccl
    return torch.randn(8, 16, generator=g).to(device), torch.randint(0, 4, (8,), generator=g).to(device)


def _maxdiff(xs, ys) -> float:
    return max([(x.detach().double() - y.detach().double()).abs().max().item() for x, y in zip(xs, ys)] + [0.0])


def parity(model: str, steps: int = 3, micro: int = 1, hook=None, torch_hook="same", **kwargs) -> dict:
    """Train commlab's and torch's DDP the same way; report the largest differences."""
    torch.manual_seed(dist.get_rank())  # different initial values: construction must broadcast
    ours_module = MODELS[model]().to(commlab.Runtime.current().device)
    theirs_module = copy.deepcopy(ours_module)
    commlab_only = ("algorithm", "overlap", "first_bucket_mb", "round_robin_groups")
    ours_kwargs = {k: kwargs.pop(k) for k in commlab_only if k in kwargs}
    ours = commlab.DistributedDataParallel(ours_module, **kwargs, **ours_kwargs)
    with warnings.catch_warnings():  # torch 2.13 deprecates broadcast_buffers; we keep its name
        warnings.simplefilter("ignore", FutureWarning)
        theirs = TorchDDP(theirs_module, **kwargs)
    if hook is not None:
        ours.register_comm_hook(None, hook)
    torch_hook = hook if torch_hook == "same" else torch_hook
    if torch_hook is not None:
        theirs.register_comm_hook(None, torch_hook)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (ours, theirs)]
    for step in range(steps):
        for ddp, opt in zip((ours, theirs), opts):
            opt.zero_grad()
            for k in range(micro):
                x, y = _data(step, k)
                if k < micro - 1:
                    with ddp.no_sync():
                        nn.functional.cross_entropy(ddp(x), y).backward()
                else:
                    nn.functional.cross_entropy(ddp(x), y).backward()
            opt.step()
    # SGD leaves .grad in place after step(): these are the last iteration's synchronised grads.
    ours_grads = [p.grad for p in ours.module.parameters()]
    theirs_grads = [p.grad for p in theirs.module.parameters()]
    grads_none = [(a is None, b is None) for a, b in zip(ours_grads, theirs_grads)]
    both = [(a, b) for a, b in zip(ours_grads, theirs_grads) if a is not None and b is not None]
    return {
        "params": _maxdiff(ours.module.parameters(), theirs.module.parameters()),
        "buffers": _maxdiff(ours.module.buffers(), theirs.module.buffers()),
        "grads": _maxdiff([a for a, _ in both], [b for _, b in both]),
        "grads_none_match": all(a == b for a, b in grads_none),
        "grads_none": [a for a, _ in grads_none],
        "buckets": ours.bucket_indices,
        "torch_buckets": torch_buckets(theirs),
        "timings": len(ours.iteration_timings),
        "grad_is_view": [_is_view_of_bucket(ours, p) for p in ours.module.parameters()],
        "bucket_sizes": ours.bucket_sizes,
    }


def torch_buckets(ddp: TorchDDP) -> list[list[int]]:
    """torch DDP's current buckets in reduction order, as indices of its trainable parameters."""
    index = {id(p): i for i, p in enumerate(p for p in ddp.module.parameters() if p.requires_grad)}
    return [[index[id(p)] for p in b.parameters()] for b in ddp.reducer._get_zeros_like_grad_buckets()]


def _is_view_of_bucket(ddp, p) -> bool:
    return p.grad is not None and any(
        p.grad.data_ptr() == v.data_ptr() for b in ddp.reducer.buckets for v in b.views
    )


def buckets_before_after(model_fn, **kwargs) -> dict:
    """Buckets at construction and after two iterations (i.e. after the rebuild), ours and torch's."""
    torch.manual_seed(0)
    module = model_fn()
    ours = commlab.DistributedDataParallel(module, **kwargs)
    theirs = TorchDDP(copy.deepcopy(module), **kwargs)
    out = {"ours_before": ours.bucket_indices, "torch_before": torch_buckets(theirs)}
    for ddp in (ours, theirs):
        for step in range(2):
            x = torch.randint(0, 64, (2, 8)) if isinstance(module, TinyTransformer) else torch.randn(4, 16)
            ddp(x).float().pow(2).mean().backward()
    out.update(ours_after=ours.bucket_indices, torch_after=torch_buckets(theirs), sizes=ours.bucket_sizes)
    return out


def timing_run(overlap: bool) -> dict:
    torch.manual_seed(0)
    model = mlp(6, 64, in_features=16, classes=4).to(commlab.Runtime.current().device)
    ddp = commlab.DistributedDataParallel(model, bucket_cap_mb=0.02, overlap=overlap)
    for step in range(3):
        with ddp.no_sync():
            nn.functional.cross_entropy(ddp(_data(step)[0]), _data(step)[1]).backward()
        nn.functional.cross_entropy(ddp(_data(step)[0]), _data(step)[1]).backward()
    timings = list(ddp.iteration_timings)
    count = len(timings)
    ddp.reset_timings()
    return {"count": count, "last": timings[-1] if count else None, "after_reset": len(ddp.iteration_timings)}


def hook_twice_error() -> str:
    ddp = commlab.DistributedDataParallel(mlp(1, 8, in_features=16))
    ddp.register_comm_hook(None, default_hooks.allreduce_hook)
    try:
        ddp.register_comm_hook(None, default_hooks.allreduce_hook)
    except RuntimeError as e:
        return str(e)
    return ""


def rewrap() -> dict:
    """Wrapping a module again after dropping its first DDP: the old hooks go with it."""
    module = mlp(2, 8, in_features=16, classes=4)
    first = commlab.DistributedDataParallel(module)
    hooks_with_first = len(module[0].weight._post_accumulate_grad_hooks)
    del first
    gc.collect()
    second = commlab.DistributedDataParallel(module, bucket_cap_mb=1e-9)
    for step in range(2):
        nn.functional.cross_entropy(second(_data(step)[0]), _data(step)[1]).backward()
    return {
        "hooks_with_first": hooks_with_first,
        "hooks_with_second": len(module[0].weight._post_accumulate_grad_hooks),
        "timings": len(second.iteration_timings),
    }


def unused_without_flag_error() -> str:
    """Branchy's ``dead`` layer gets no gradient; without find_unused_parameters that is an error."""
    ddp = commlab.DistributedDataParallel(Branchy(), bucket_cap_mb=1e-9)
    for step in range(2):  # the first iteration has one bucket; the error is the same either way
        try:
            nn.functional.cross_entropy(ddp(_data(step)[0]), _data(step)[1]).backward()
        except RuntimeError as e:
            return str(e)
    return ""


def run_world2() -> dict:
    """Everything checked at world size 2, in one process group."""
    tiny, huge = 1e-9, 1e6
    cases = {
        "mlp": parity("mlp"),
        "bn": parity("bn"),
        "bn_no_broadcast": parity("bn", broadcast_buffers=False),
        "tied": parity("tied"),
        "unused": parity("branchy", find_unused_parameters=True),
        "unused_view": parity("branchy", find_unused_parameters=True, gradient_as_bucket_view=True),
        "cap_tiny": parity("mlp", bucket_cap_mb=tiny),
        "cap_1": parity("mlp", bucket_cap_mb=1),
        "cap_25": parity("mlp", bucket_cap_mb=25),
        "cap_huge": parity("mlp", bucket_cap_mb=huge),
        "view": parity("mlp", bucket_cap_mb=tiny, gradient_as_bucket_view=True),
        "no_sync": parity("bn", steps=2, micro=4),
        "no_sync_view": parity("mlp", steps=2, micro=4, gradient_as_bucket_view=True),
        "fp16_hook": parity("mlp", bucket_cap_mb=tiny, hook=default_hooks.fp16_compress_hook),
        # torch refuses bf16_compress_hook without NCCL: compare with its plain DDP instead.
        "bf16_hook": parity("mlp", hook=default_hooks.bf16_compress_hook, torch_hook=None),
        "allreduce_hook": parity("tied", bucket_cap_mb=tiny, hook=default_hooks.allreduce_hook),
        "no_overlap": parity("mlp", bucket_cap_mb=tiny, overlap=False),
        "round_robin": parity("mlp", bucket_cap_mb=tiny, round_robin_groups=3),
        "static_graph": parity("mlp", static_graph=True),
        # No torch equivalent: same values as torch's default layout, a different first bucket.
        "first_bucket": parity("mlp", bucket_cap_mb=0.01, first_bucket_mb=0.002),
        # commlab's own all-reduce algorithms under DDP (their correctness is tested elsewhere;
        # here: launched from autograd hooks, several in flight, round-robin groups).
        "ring": parity("mlp", bucket_cap_mb=tiny, algorithm="ring"),
        "tree": parity("tied", bucket_cap_mb=tiny, algorithm="tree", round_robin_groups=2),
        "halving_doubling": parity("bn", bucket_cap_mb=1e-3, algorithm="halving_doubling", overlap=False),
    }
    small_transformer = lambda: TinyTransformer(vocab=64, d_model=32, layers=2, heads=2, seq=8)  # noqa: E731
    layouts = {
        "mlp_default": buckets_before_after(lambda: mlp(4, 128, in_features=16)),
        # 4 MiB weights: after the rebuild torch's 1 MiB first bucket holds only the last layer.
        "mlp_default_first_bucket": buckets_before_after(lambda: mlp(3, 1024, in_features=16)),
        "mlp_cap_tiny": buckets_before_after(lambda: mlp(4, 128, in_features=16), bucket_cap_mb=1e-9),
        "mlp_cap_0.1": buckets_before_after(lambda: mlp(4, 128, in_features=16), bucket_cap_mb=0.1),
        "transformer_default": buckets_before_after(small_transformer),
        "transformer_cap_0.02": buckets_before_after(small_transformer, bucket_cap_mb=0.02),
        "transformer_find_unused": buckets_before_after(
            small_transformer, bucket_cap_mb=0.02, find_unused_parameters=True
        ),
    }
    return {
        "cases": cases,
        "layouts": layouts,
        "timing_overlap": timing_run(True),
        "timing_no_overlap": timing_run(False),
        "hook_twice": hook_twice_error(),
        "rewrap": rewrap(),
        "unused_error": unused_without_flag_error(),
    }


class _Wider(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.fc = nn.Linear(16, width)


def run_world3() -> dict:
    """World size 3: averaging over an odd world, unused parameters, and a shape mismatch."""
    out = {
        "mlp": parity("mlp", bucket_cap_mb=1e-9),
        "unused": parity("branchy", bucket_cap_mb=1e-9, find_unused_parameters=True, round_robin_groups=2),
        "fp16_hook": parity("bn", hook=default_hooks.fp16_compress_hook),
        "ring": parity("mlp", bucket_cap_mb=1e-9, algorithm="ring"),
        "rr_list": parity("tied", bucket_cap_mb=1e-9, round_robin_groups=[dist.new_group([0, 1, 2]) for _ in range(2)]),
    }
    try:
        commlab.DistributedDataParallel(_Wider(8 if dist.get_rank() != 2 else 9))
        out["mismatch"] = ""
    except ValueError as e:
        out["mismatch"] = str(e)
    return out


def run_cuda() -> dict:
    """The same code on CUDA tensors with NCCL: parity with torch and CUDA-event timings."""
    return {
        "mlp": parity("mlp", bucket_cap_mb=1e-9),
        "bn_view": parity("bn", gradient_as_bucket_view=True),
        "fp16_hook": parity("mlp", hook=default_hooks.fp16_compress_hook),
        "timing_overlap": timing_run(True),
    }
