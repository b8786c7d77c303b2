"""Rank-side code of the torch-parity tests: each edge users hit, on torch's DDP and commlab's.

``side_by_side`` builds one model per rank (different initial values on every rank, so the
construction broadcast matters), wraps a copy in each DDP, trains both the same way with an
optimizer whose weight decay and momentum make a None gradient differ from a zero one, and
returns what the parent compares: parameter and buffer differences, which gradients are None,
state_dict keys, bucket layouts, and where and how each raised.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import warnings

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as TorchDDP
from torch.utils.checkpoint import checkpoint

import commlab
from tests.support.ddp_cases import Branchy, _data, _maxdiff, bn_model

COMMLAB_ONLY = ("algorithm", "overlap", "first_bucket_mb", "round_robin_groups")
Pair = collections.namedtuple("Pair", "main aux")


@dataclasses.dataclass
class Out:
    main: torch.Tensor
    aux: torch.Tensor | None


class Heads(nn.Module):
    """A trunk, a ``main`` head the loss uses, an ``aux`` head it may not, a ``dead`` layer no
    output depends on; ``kind`` picks the structure the outputs are returned in."""

    def __init__(self, kind: str = "tuple"):
        super().__init__()
        self.kind, self.calls = kind, 0
        self.trunk, self.main, self.aux, self.dead = (nn.Linear(16, 16), nn.Linear(16, 4), nn.Linear(16, 4), nn.Linear(16, 4))

    def forward(self, x):
        h = torch.relu(self.trunk(x))
        main, aux = self.main(h), self.aux(h)
        self.calls += 1
        return {
            "tensor": lambda: main + 0 * aux.detach(),
            "tuple": lambda: (main, aux),
            "list": lambda: [main, aux],
            "dict": lambda: {"main": main, "aux": aux, "step": self.calls},
            "namedtuple": lambda: Pair(main, aux),
            "dataclass": lambda: Out(main, aux),
            "dataclass_none": lambda: Out(main, aux if self.calls % 2 else None),
            "nested": lambda: {"a": [main, (aux, None)], "b": Out(main, None)},
        }[self.kind]()


def main_of(out):
    """The tensor the loss uses, whatever the structure."""
    if isinstance(out, dict):
        return main_of(out["main"] if "main" in out else out["a"][0])
    if isinstance(out, (tuple, list)):
        return out[0]
    if isinstance(out, Out):
        return out.main
    return out


def loss_of(out, y):
    loss = nn.functional.cross_entropy(main_of(out), y)
    if isinstance(out, Out) and out.aux is not None and not isinstance(out.main, type(None)):
        loss = loss + out.aux.pow(2).mean()  # dataclass outputs: aux takes part when present
    return loss


class Checkpointed(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp, self.block, self.out = nn.Linear(16, 32), nn.Sequential(nn.Linear(32, 32), nn.Tanh()), nn.Linear(32, 4)

    def forward(self, x):
        return self.out(checkpoint(self.block, torch.relu(self.inp(x)), use_reentrant=False))


class FirstCallOnly(nn.Module):
    """Uses ``extra`` in its first forward only: a graph that is not static."""

    def __init__(self):
        super().__init__()
        self.fc, self.extra, self.calls = nn.Linear(16, 4), nn.Linear(4, 4), 0

    def forward(self, x):
        self.calls += 1
        h = self.fc(x)
        return self.extra(h) if self.calls == 1 else h


class WithIgnored(nn.Module):
    """``ign`` and the ``count`` buffer are told to torch's DDP to be ignored."""

    def __init__(self):
        super().__init__()
        self.fc, self.ign, self.head = nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 4)
        self.register_buffer("count", torch.tensor([dist.get_rank() * 7], dtype=torch.int64))
        self.register_buffer("scale", torch.full((4,), 1.0 + dist.get_rank()))
        TorchDDP._set_params_and_buffers_to_ignore_for_model(self, ["ign.weight", "ign.bias", "count"])

    def forward(self, x):
        self.count += 1
        h = torch.relu(self.fc(x))
        return self.head(h + self.ign(h)) * self.scale


class IntBuffers(nn.Module):
    """Integer buffers whose values no float type holds exactly, next to a float one."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 4)
        big = 2**62 + 12345 + dist.get_rank()
        self.register_buffer("i64", torch.tensor([big, -big], dtype=torch.int64))
        self.register_buffer("i32", torch.tensor([2**31 - 1 - dist.get_rank()], dtype=torch.int32))
        self.register_buffer("flag", torch.tensor([dist.get_rank() % 2 == 0]))

    def forward(self, x):
        return self.fc(x)


class SparseEmbedding(nn.Module):
    """An Embedding with sparse=True (indices from the data) next to a dense layer; ``dead``
    adds a layer no output uses, ``skip_call`` leaves the embedding out of that forward (from 0)."""

    def __init__(self, bag: bool = False, dead: bool = False, skip_call: int | None = None):
        super().__init__()
        self.emb = nn.EmbeddingBag(20, 4, sparse=True) if bag else nn.Embedding(20, 4, sparse=True)
        self.fc = nn.Linear(16, 4)
        self.dead = nn.Linear(4, 4) if dead else None
        self.skip_call, self.calls = skip_call, 0

    def forward(self, x):
        self.calls += 1
        if self.calls - 1 == self.skip_call:
            return self.fc(x)
        idx = (x.abs() * 10).long() % 20
        e = self.emb(idx) if isinstance(self.emb, nn.EmbeddingBag) else self.emb(idx).mean(1)
        return self.fc(x) + e


class SparseOnly(nn.Module):
    """Every trainable parameter has a sparse gradient: no dense bucket at all."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(20, 4, sparse=True)

    def forward(self, x):
        return self.emb((x.abs() * 10).long() % 20).mean(1)


def _dense(g):
    return g.to_dense() if g is not None and g.is_sparse else g


def _summary(ours, theirs) -> dict:
    ours_grads = [_dense(p.grad) for p in ours.module.parameters()]
    theirs_grads = [_dense(p.grad) for p in theirs.module.parameters()]
    both = [(a, b) for a, b in zip(ours_grads, theirs_grads) if a is not None and b is not None]
    return {
        "params": _maxdiff(ours.module.parameters(), theirs.module.parameters()),
        "buffers": _maxdiff(ours.module.buffers(), theirs.module.buffers()),
        "grads": _maxdiff([a for a, _ in both], [b for _, b in both]),
        "grads_none": [g is None for g in ours_grads],
        "torch_grads_none": [g is None for g in theirs_grads],
        "first_grad": next((g.flatten()[0].item() for g in ours_grads if g is not None), None),
        "finite": all(torch.isfinite(g).all().item() for g, _ in both),
        "state_dict": list(ours.state_dict()) == list(theirs.state_dict()),
        "buckets": None if getattr(ours, "_sparse", None) else [[ours.reducer.names[i] for i in b] for b in ours.bucket_indices],
        "torch_buckets": bucket_names(theirs),
        "sparse_grads": [p.grad is not None and p.grad.is_sparse for p in ours.module.parameters()],
        "torch_sparse_grads": [p.grad is not None and p.grad.is_sparse for p in theirs.module.parameters()],
    }


def bucket_names(ddp: TorchDDP) -> list[list[str]]:
    """torch DDP's buckets in reduction order, as parameter names (it may ignore some)."""
    name = {id(p): n for n, p in ddp.module.named_parameters()}
    if any(getattr(m, "sparse", False) for m in ddp.module.modules()):
        return None  # torch cannot list a sparse bucket (_get_zeros_like_grad_buckets fails on it)
    return [[name[id(p)] for p in b.parameters()] for b in ddp.reducer._get_zeros_like_grad_buckets()]


def construction(**kwargs) -> dict:
    """Build both DDPs around a CPU module with these device keywords: each one's error
    (type, message) or the (device_ids, output_device, dim) it kept."""
    out = {}
    for name, make in (("ours", commlab.DistributedDataParallel), ("torch", TorchDDP)):
        try:
            ddp = make(nn.Linear(4, 4), **kwargs)
            out[name] = (ddp.device_ids, ddp.output_device, ddp.dim)
        except Exception as e:  # noqa: BLE001 -- the type is compared
            out[name] = (type(e).__name__, str(e))
    return out


DEVICE_KEYWORDS = {
    "cpu_device_ids": {"device_ids": [0]},
    "cpu_device_ids_two": {"device_ids": [0, 1]},
    "cpu_device_ids_device": {"device_ids": [torch.device("cpu")]},
    "cpu_output_device": {"output_device": 1},
    "cpu_output_device_zero": {"output_device": 0},  # falsy: torch lets it pass
    "cpu_empty_ids_dim": {"device_ids": [], "dim": 1},
}


def default_step(ddp, step):
    x, y = _data(step)
    loss_of(ddp(x), y).backward()


def side_by_side(build, steps=4, step_fn=default_step, lr=0.1, plain_sgd=False, **kwargs) -> dict:
    """Train commlab's and torch's DDP the same way on this rank; see the module docstring."""
    torch.manual_seed(dist.get_rank())
    module = build().to(commlab.Runtime.current().device)
    ours_only = {k: kwargs.pop(k) for k in COMMLAB_ONLY if k in kwargs}
    hook = kwargs.pop("comm_hook", None)
    out: dict = {"errors": {}}
    ddps = []
    for name, make in (("ours", commlab.DistributedDataParallel), ("torch", TorchDDP)):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # broadcast_buffers / check_reduction
            ddp = make(copy.deepcopy(module), **kwargs, **(ours_only if name == "ours" else {}))
        if hook is not None:
            ddp.register_comm_hook(None, hook)
        decay = {} if plain_sgd else {"momentum": 0.9, "weight_decay": 0.1}  # SGD has no sparse weight decay
        opt = torch.optim.SGD(ddp.parameters(), lr=lr, **decay)
        for step in range(steps):
            try:
                opt.zero_grad()
                step_fn(ddp, step)
                opt.step()
            except RuntimeError as e:
                out["errors"][name] = (step, str(e).split(". ")[0])
                break
        ddps.append(ddp)
    out.update(_summary(*ddps))
    return out


def join_side_by_side(build, join_kwargs: dict, **kwargs) -> dict:
    """Rank r trains on 2 + 2r batches inside ``ddp.join(**join_kwargs)``, on both DDPs."""
    batches = 2 + 2 * dist.get_rank()

    def step_fn(ddp, _step):
        with ddp.join(**join_kwargs):
            for step in range(batches):
                ddp.zero_grad()  # the optimizer below steps once at the end: plain accumulation
                default_step(ddp, step)
                with torch.no_grad():
                    for p in ddp.parameters():
                        if p.grad is not None:
                            p -= 0.1 * p.grad

    return side_by_side(build, steps=1, step_fn=step_fn, lr=0.0, **kwargs)


# -- step functions for the edges --------------------------------------------------------------
def no_sync_after_first(ddp, step):
    if step >= 1:
        with ddp.no_sync():
            default_step(ddp, 100 + step)
    default_step(ddp, step)


def no_grad_eval_between(ddp, step):
    default_step(ddp, step)
    ddp.eval()
    with torch.no_grad():
        ddp(_data(step, 1)[0])
    assert ddp.train() is ddp and ddp.module.training


def fp_overflow_step(ddp, step):
    """Every gradient element is 40000 on each rank: a sum of two or three overflows fp16."""
    x = torch.ones(8, 4, dtype=next(ddp.parameters()).dtype)
    (ddp(x).sum() * 5000).backward()


def halved_sum(state, bucket):
    """A comm hook that sums, then halves: not torch's average, so a sparse bucket that missed
    the hook, or that was divided before it, shows at world sizes other than 2."""
    future = dist.all_reduce(bucket.buffer(), group=state, async_op=True).get_future()
    return future.then(lambda f: f.value()[0] / 2)


def cases(world: int) -> dict:
    heads = lambda kind: (lambda: Heads(kind))  # noqa: E731
    tiny = 1e-9
    out = {
        # 1: an output the loss does not use
        "unused_output": side_by_side(heads("tuple"), find_unused_parameters=True),
        "unused_output_view": side_by_side(heads("tuple"), find_unused_parameters=True, gradient_as_bucket_view=True),
        "unused_output_tiny": side_by_side(heads("tuple"), find_unused_parameters=True, bucket_cap_mb=tiny),
        "unused_output_noflag": side_by_side(heads("tuple")),
        # 2: structures
        **{
            f"structure_{kind}": side_by_side(heads(kind), find_unused_parameters=True, bucket_cap_mb=tiny)
            for kind in ("tensor", "list", "dict", "namedtuple", "dataclass", "dataclass_none", "nested")
        },
        # commlab's own algorithms with find_unused_parameters
        "ring_unused": side_by_side(heads("dataclass_none"), find_unused_parameters=True, bucket_cap_mb=tiny, algorithm="ring"),
        "tree_unused": side_by_side(Branchy, find_unused_parameters=True, bucket_cap_mb=tiny, algorithm="tree"),
        # 3: static graph
        "static_dead": side_by_side(Branchy, static_graph=True),
        "static_dead_tiny": side_by_side(Branchy, static_graph=True, bucket_cap_mb=tiny),
        "static_no_sync": side_by_side(Branchy, static_graph=True, step_fn=no_sync_after_first),
        "static_unused_output": side_by_side(heads("tuple"), static_graph=True, find_unused_parameters=True),
        "static_changed": side_by_side(FirstCallOnly, static_graph=True),
        "dynamic_changed": side_by_side(FirstCallOnly),
        # 6: ignored parameters and buffers
        "ignored": side_by_side(WithIgnored),
        # 7: torch's keywords
        "init_sync_off": side_by_side(bn_model, init_sync=False),
        "check_reduction": side_by_side(bn_model, check_reduction=True),
        "forward_sync_off": side_by_side(bn_model, forward_sync_buffers=False),
        # 8: no_grad forward between steps, checkpointing
        "no_grad_between": side_by_side(bn_model, step_fn=no_grad_eval_between),
        "checkpoint": side_by_side(Checkpointed, bucket_cap_mb=tiny),
        "checkpoint_unused": side_by_side(Checkpointed, find_unused_parameters=True),
        # 4: uneven inputs
        "join": join_side_by_side(bn_model, {}),
        "join_effective_world": join_side_by_side(bn_model, {"divide_by_initial_world_size": False}),
        "join_unused": join_side_by_side(Branchy, {}, find_unused_parameters=True, bucket_cap_mb=tiny),
        "join_ring": join_side_by_side(heads("tuple"), {}, find_unused_parameters=True, algorithm="ring"),
        "join_throw": join_side_by_side(bn_model, {"throw_on_early_termination": True}),
        # 5: sparse gradients
        "sparse": side_by_side(SparseEmbedding, plain_sgd=True),
        "sparse_bag_tiny": side_by_side(lambda: SparseEmbedding(bag=True), plain_sgd=True, bucket_cap_mb=tiny),
        "sparse_ring": side_by_side(SparseEmbedding, plain_sgd=True, algorithm="ring", step_fn=no_sync_after_first),
        "sparse_find_unused": side_by_side(lambda: SparseEmbedding(dead=True), plain_sgd=True, find_unused_parameters=True),
        "sparse_static": side_by_side(lambda: SparseEmbedding(dead=True), plain_sgd=True, static_graph=True, step_fn=no_sync_after_first),
        "sparse_hook": side_by_side(SparseEmbedding, plain_sgd=True, comm_hook=default_hooks.allreduce_hook),
        "sparse_all": side_by_side(SparseOnly, plain_sgd=True),
        "sparse_all_unused_hook": side_by_side(SparseOnly, plain_sgd=True, find_unused_parameters=True,
                                               comm_hook=default_hooks.allreduce_hook),
        "sparse_hook_unused": side_by_side(lambda: SparseEmbedding(dead=True), plain_sgd=True, find_unused_parameters=True, comm_hook=halved_sum),
        "sparse_unused_raises": side_by_side(lambda: SparseEmbedding(skip_call=1), plain_sgd=True, find_unused_parameters=True),
        "sparse_static_unused_raises": side_by_side(lambda: SparseEmbedding(skip_call=0), plain_sgd=True, static_graph=True),
        "sparse_noflag_unused_raises": side_by_side(lambda: SparseEmbedding(skip_call=1), plain_sgd=True),
        # 9: low precision and integer buffers
        "fp16": side_by_side(lambda: nn.Linear(4, 1).half(), step_fn=fp_overflow_step, steps=1),
        "fp16_ring": side_by_side(lambda: nn.Linear(4, 1).half(), step_fn=fp_overflow_step, steps=1, algorithm="ring"),
        "bf16": side_by_side(lambda: nn.Linear(4, 1).bfloat16(), step_fn=fp_overflow_step, steps=1),
        "int_buffers": side_by_side(IntBuffers),
    }
    out["device_keywords"] = {name: construction(**kw) for name, kw in DEVICE_KEYWORDS.items()}
    ddp = commlab.DistributedDataParallel(IntBuffers())
    out["int_buffer_values"] = [b.tolist() for b in ddp.module.buffers()]
    out["fp16_grad"], out["fp16_ring_grad"] = out["fp16"]["first_grad"], out["fp16_ring"]["first_grad"]
    out["sparse_fallback"] = commlab.DistributedDataParallel(SparseEmbedding(), algorithm="ring").sparse_fallback
    torch.manual_seed(dist.get_rank())
    ddp = commlab.DistributedDataParallel(WithIgnored())
    default_step(ddp, 0)
    module = ddp.module
    out["ignored_values"] = [module.ign.weight.sum().item(), module.ign.weight.grad.sum().item(), module.count.item()]
    out["synced_values"] = [module.fc.weight.sum().item(), module.fc.weight.grad.sum().item(), module.scale.tolist()]
    return out
