"""A model's tensor-parallel share profiled in one process: split shapes, real operators, no peers.

:func:`split_locally` replaces the modules a plan names by commlab.tensor's own split layers, as
:func:`commlab.tensor.parallelize` does, but over a :class:`RecordingGroup`: a group of ``tp``
whose collectives do not communicate (an all-reduce returns its input, an all-gather repeats the
local block) and log what they would have sent. One rank's compute then runs at the split shapes
(1/tp of the heads and features), and the log holds exactly the collectives the operators issue,
with their bytes, per layer and pass. :func:`profile_split` times it per layer (a layer: what
runs before the first block, each block of the model's longest ModuleList, and what follows the
last, with the loss) and measures what one micro-batch holds at its peak; the result is a
:class:`~commlab.costmodel.planner.layouts.SplitProfile`. Nothing here runs a tensor-parallel job.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from commlab.costmodel.planner.layouts import SplitProfile
from commlab.tensor.comm import TPGroup
from commlab.tensor.layers import ColwiseLinear, InputCache, RowwiseLinear, VocabEmbedding
from commlab.tensor.plan import SEQUENCE_KINDS, resolve


@dataclass(frozen=True)
class RecordingGroup(TPGroup):
    """A tensor-parallel group of ``size`` that only logs (op, bytes, ``where[0]``) per collective."""

    log: list = field(default_factory=list, compare=False)
    where: list = field(default_factory=lambda: [None], compare=False)

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        self.log.append(("all_reduce", tensor.numel() * tensor.element_size(), self.where[0]))
        return tensor

    def all_gather(self, local: torch.Tensor, dim: int) -> torch.Tensor:
        out = torch.cat([local] * self.size, dim)
        self.log.append(("all_gather", out.numel() * out.element_size(), self.where[0]))
        return out

    def reduce_scatter(self, full: torch.Tensor, dim: int) -> torch.Tensor:
        self.log.append(("reduce_scatter", full.numel() * full.element_size(), self.where[0]))
        return full.narrow(dim, 0, full.shape[dim] // self.size).contiguous()


def split_locally(module: nn.Module, plan: Mapping[str, str], tp: int) -> RecordingGroup:
    """Replace the modules ``plan`` names by rank 0's split layers over a :class:`RecordingGroup`
    of ``tp`` (ValueError for a plan :func:`commlab.tensor.resolve` refuses); returns the group."""
    group = RecordingGroup(None, tp, 0)
    cache = InputCache()
    module.register_forward_pre_hook(cache.clear)
    for name, kind in resolve(module, plan, tp).items():
        if kind in SEQUENCE_KINDS:
            continue  # sequence parallelism is not planned here
        target = module.get_submodule(name)
        if kind == "vocab":
            new = VocabEmbedding(target, group)
        elif kind == "rowwise":
            new = RowwiseLinear(target, group, sequence_parallel=False)
        else:
            new = ColwiseLinear(target, group, cache, sequence_parallel=False, gather_output=kind == "colwise_gather")
        parent, _, child = name.rpartition(".")
        setattr(module.get_submodule(parent), child, new)
    return group


class Checkpointed(nn.Module):
    """A block whose forward is recomputed in backward (activation checkpointing, non-reentrant)."""

    def __init__(self, block: nn.Module):
        super().__init__()
        self.block = block

    def forward(self, x):
        return checkpoint(self.block, x, use_reentrant=False)


def blocks_of(model: nn.Module) -> tuple[str, nn.ModuleList]:
    """The model's longest ModuleList: its blocks, the planner's layers between its ends."""
    lists = [(n, m) for n, m in model.named_modules() if n and isinstance(m, nn.ModuleList)]
    if not lists:
        raise ValueError(f"{type(model).__name__} has no nn.ModuleList of blocks")
    return max(lists, key=lambda nm: len(nm[1]))


def checkpoint_blocks(model: nn.Module) -> nn.Module:
    """Every block of :func:`blocks_of` recomputed in backward; returns ``model``."""
    _, blocks = blocks_of(model)
    for k in range(len(blocks)):
        blocks[k] = Checkpointed(blocks[k])
    return model


def profile_split(model: nn.Module, plan: Mapping[str, str], tp: int, sample: torch.Tensor, target: torch.Tensor,
                  loss_fn: Callable, *, recompute: bool = False, repeat: int = 7) -> SplitProfile:  # fmt: skip
    """``model`` (changed in place) split for rank 0 of ``tp`` and profiled on one micro-batch (see the module docstring)."""
    group = split_locally(model, plan, tp) if tp > 1 else RecordingGroup(None, 1, 0)
    if recompute:
        checkpoint_blocks(model)
    _, blocks = blocks_of(model)
    n = len(blocks) + 2  # before the blocks, each block, after them (with the loss)
    stamps: dict[int, float] = {}

    def enter(l):
        def hook(_m, _a):
            stamps[2 * l] = time.perf_counter()
            group.where[0] = ("forward", l + 1)
        return hook

    def leave(l):
        def hook(_m, _a, out):
            stamps[2 * l + 1] = time.perf_counter()
            group.where[0] = ("forward", l + 2)
            if out.requires_grad:  # its gradient arriving starts the block's backward
                out.register_hook(lambda g: group.where.__setitem__(0, ("backward", l + 1)))
        return hook

    hooks = [b.register_forward_pre_hook(enter(l)) for l, b in enumerate(blocks)]
    hooks += [b.register_forward_hook(leave(l)) for l, b in enumerate(blocks)]
    params = [p for p in model.parameters() if p.requires_grad]

    def one() -> tuple[list[float], float]:
        for p in params:
            if p.grad is not None:
                p.grad.zero_()
        group.log.clear()
        group.where[0] = ("forward", 0)
        t0 = time.perf_counter()
        loss = loss_fn(model(sample), target)
        t1 = time.perf_counter()
        group.where[0] = ("backward", n - 1)
        loss.backward()
        t2 = time.perf_counter()
        # Layer 0 ends as the first block starts; a block runs until the next starts (the glue
        # between blocks is its); the last layer runs from the last block's end to the loss.
        starts = [t0] + [stamps[2 * l] for l in range(len(blocks))] + [stamps[2 * len(blocks) - 1]]
        return [b - a for a, b in zip(starts, starts[1:] + [t1])], t2 - t1

    try:
        one()  # allocates the gradients
        runs = [one() for _ in range(repeat)]
        log = list(group.log)
        from commlab.memtrack import track_peak

        with track_peak("cpu") as seen:
            one()
    finally:
        for h in hooks:
            h.remove()
    forward = [statistics.median(r[0][l] for r in runs) for l in range(n)]
    backward_total = statistics.median(r[1] for r in runs)
    # The backward is timed whole; its layers share it as their forwards do (only its placement
    # relative to DDP's buckets depends on the share).
    backward = [backward_total * f / max(sum(forward), 1e-12) for f in forward]
    fwd_c = [tuple((op, b) for op, b, (p, l) in log if p == "forward" and l == k) for k in range(n)]
    bwd_c = [tuple((op, b) for op, b, (p, l) in log if p == "backward" and l == k) for k in range(n)]
    sizes = _param_sizes(model, blocks, n)
    return SplitProfile(tuple(forward), tuple(backward), tuple(fwd_c), tuple(bwd_c), sizes, float(seen.peak_bytes), 0.0,
                        tp, recompute)  # fmt: skip


def _param_sizes(model: nn.Module, blocks: nn.ModuleList, n: int) -> tuple[tuple[int, ...], ...]:
    """This rank's parameter bytes per layer, module order: the blocks' own, the rest split by
    where they come in ``named_parameters`` (before the first block's, or after)."""
    inside = {id(p): l + 1 for l, b in enumerate(blocks) for p in b.parameters()}
    out: list[list[int]] = [[] for _ in range(n)]
    seen_block = False
    for _, p in model.named_parameters():
        if not p.requires_grad:
            continue
        layer = inside.get(id(p))
        seen_block |= layer is not None
        out[layer if layer is not None else (n - 1 if seen_block else 0)].append(p.numel() * p.element_size())
    return tuple(tuple(x) for x in out)


def ddp_sync_seconds(model: nn.Module, sample: torch.Tensor, target: torch.Tensor, loss_fn: Callable, group,
                     repeat: int = 7) -> float:  # fmt: skip
    """What a synchronising micro-batch of commlab's DDP costs beyond the bare model's: forward +
    backward of ``model`` bare, then wrapped in DDP on ``group`` (a one-rank process group: the
    gradients' copies into and out of their buckets and the reducer's hooks, no peer to wait
    for), medians of ``repeat``; the difference, never below 0. Wraps ``model`` for good."""
    import commlab  # the DDP under test: loaded only when a data-parallel share is profiled

    def seconds(run: Callable[[], torch.Tensor]) -> float:
        run().backward()  # warm: buffers, and the DDP's rebuilt buckets
        times = []
        for _ in range(repeat):
            t0 = time.perf_counter()
            run().backward()
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    bare = seconds(lambda: loss_fn(model(sample), target))
    ddp = commlab.DistributedDataParallel(model, process_group=group)
    return max(seconds(lambda: loss_fn(ddp(sample), target)) - bare, 0.0)
