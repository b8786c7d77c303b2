"""Rank-side code of the training-loop test: a GPT with tied embeddings trained 10 steps with
parameter groups (by name and by ``ndim``), ``clip_grad_norm_`` every step and a GradScaler that
sees an inf on one rank at one step, by commlab's ShardedDataParallel at stages 1-3 and by
torch's ``fully_shard`` (one unit per block plus the root, as FSDP2 users wrap a GPT), side by
side; the parent asserts on the plain data returned.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from commlab.models import GPT, lm_loss
from commlab.sharded import ShardedDataParallel
from tests.support.helpers import error_of

STEPS, INF_STEP, INF_RANK, MAX_NORM = 10, 4, 0, 0.1
INF_PARAM = "layers.0.fc.weight"  # its first element gets an inf on one rank, after the reduction


def _gpt() -> nn.Module:
    torch.manual_seed(0)  # fully_shard does not broadcast: every rank builds the same values
    model = GPT(vocab=64, d_model=32, layers=2, heads=4, seq=16)
    model.head.weight = model.tok.weight  # tied: one parameter held by two modules
    return model


def _optimizer(named: list[tuple[str, nn.Parameter]]) -> torch.optim.Optimizer:
    """SGD with momentum (an error scaled by the world size shows), three groups: matrices of
    the first block by name, other matrices, and vectors (no weight decay) by ndim."""
    first = [p for n, p in named if n.startswith("layers.0.") and p.ndim >= 2]
    matrices = [p for n, p in named if not n.startswith("layers.0.") and p.ndim >= 2]
    vectors = [p for _, p in named if p.ndim < 2]
    return torch.optim.SGD([
        {"params": first, "lr": 0.05, "weight_decay": 0.1},
        {"params": matrices, "weight_decay": 0.1},
        {"params": vectors, "weight_decay": 0.0},
    ], lr=0.1, momentum=0.9)


def _train(model: nn.Module) -> dict:
    named = list(model.named_parameters())
    opt = _optimizer(named)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12, growth_interval=3)
    by_name = dict(named)
    norms, scales, losses = [], [], []
    for step in range(STEPS):
        g = torch.Generator().manual_seed(100 * dist.get_rank() + step)
        tokens = torch.randint(0, 64, (4, 17), generator=g)
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            logits = model(tokens[:, :-1])
        loss = lm_loss(logits.float(), tokens[:, 1:])
        scaler.scale(loss).backward()
        if step == INF_STEP and dist.get_rank() == INF_RANK:
            with torch.no_grad():
                by_name[INF_PARAM].grad.to_local().view(-1)[0] = float("inf")
        scaler.unscale_(opt)
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        norms.append(float(norm.full_tensor() if isinstance(norm, DTensor) else norm))
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
        losses.append(loss.item())
    local = {n: p.to_local().detach().clone() for n, p in model.named_parameters()}
    return {"norms": norms, "scales": scales, "losses": losses, "local": local}


def _representation(ours: ShardedDataParallel, theirs: nn.Module, plain: nn.Module) -> dict:
    """Names, shapes and placements against the unwrapped model and fully_shard's parameters."""
    world, rank = dist.get_world_size(), dist.get_rank()
    mine, fsdp = dict(ours.named_parameters()), dict(theirs.named_parameters())
    rows = {}
    for name, p in plain.named_parameters():
        chunks = torch.chunk(p.detach(), world)
        expected = chunks[rank] if rank < len(chunks) else p.detach()[:0]
        rows[name] = torch.equal(mine[name].to_local(), expected)
    return {
        "names": list(mine) == [n for n, _ in plain.named_parameters()] == list(fsdp),
        "module_names": [n for n, _ in ours.module.named_parameters()] == list(mine),
        "shapes": all(tuple(mine[n].shape) == tuple(p.shape) for n, p in plain.named_parameters()),
        "dtensor_shard0": all(isinstance(p, DTensor) and tuple(p.placements) == (Shard(0),) for p in mine.values()),
        "local_shapes_as_fully_shard": all(mine[n].to_local().shape == fsdp[n].to_local().shape for n in mine),
        "rows_are_torch_chunks": all(rows.values()),
        "tied_is_one": ours.module.head.weight is ours.module.tok.weight and "head.weight" not in mine,
    }


def _fully_shard(model: nn.Module) -> nn.Module:
    return _fully_shard_units(model, list(model.layers))


def _optimizer_rule() -> dict:
    """An optimizer class commlab does not know is refused at its first step, before it changes
    anything, unless it declares itself element-wise."""

    class MySGD(torch.optim.SGD):
        pass

    ours = ShardedDataParallel(nn.Sequential(nn.Linear(4, 4)), stage=2)
    nn.functional.mse_loss(ours(torch.ones(2, 4)), torch.zeros(2, 4)).backward()
    opt = MySGD(ours.parameters(), lr=0.1)
    before = [p.to_local().clone() for p in ours.parameters()]
    refused = error_of(opt.step)
    unchanged = all(torch.equal(a, p.to_local()) for a, p in zip(before, ours.parameters()))
    opt.elementwise = True
    return {"refused": refused, "unchanged": unchanged, "after_opt_in": error_of(opt.step)}


class _Checkpointed(nn.Module):
    """Three blocks, run under activation checkpointing unless told not to: backward runs each
    block's forward again, after the root's forward has put the DTensor shards back in the slots."""

    def __init__(self, checkpointed: bool = True):
        super().__init__()
        torch.manual_seed(1)
        self.checkpointed = checkpointed
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(3))
        self.out = nn.Linear(8, 1)

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint

        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False) if self.checkpointed else block(x)
        return self.out(x)


def _checkpointing() -> dict:
    """Each stage against fully_shard (a unit per block) over 3 steps of SGD with momentum: the
    largest difference of this rank's rows, relative to the tensor's largest value."""

    def train(model):
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        for step in range(3):
            g = torch.Generator().manual_seed(10 * dist.get_rank() + step)
            opt.zero_grad()
            nn.functional.mse_loss(model(torch.randn(4, 8, generator=g)), torch.zeros(4, 1)).backward()
            opt.step()
        return {n: p.to_local().detach() for n, p in model.named_parameters()}

    base = _Checkpointed()
    theirs = train(_fully_shard_units(base, list(base.blocks)))
    out = {}
    for stage in (1, 2, 3):
        model = _Checkpointed()
        mine = train(ShardedDataParallel(model, stage=stage, units=list(model.blocks)))
        out[stage] = _largest_difference(mine, theirs)
    return out


def _optimizer_in_backward() -> dict:
    """An optimizer per parameter stepped by its post-accumulate-grad hook (the optimizer-in-backward
    pattern) over 3 steps, each stage against fully_shard: the largest relative difference."""

    def train(model):
        opts = {p: torch.optim.SGD([p], lr=0.1, momentum=0.9) for p in model.parameters()}

        def step(p):
            opts[p].step()
            opts[p].zero_grad()

        for p in model.parameters():
            p.register_post_accumulate_grad_hook(step)
        for i in range(3):
            g = torch.Generator().manual_seed(10 * dist.get_rank() + i)
            nn.functional.mse_loss(model(torch.randn(4, 8, generator=g)), torch.zeros(4, 1)).backward()
        return {n: p.to_local().detach() for n, p in model.named_parameters()}

    base = _Checkpointed(checkpointed=False)
    theirs = train(_fully_shard_units(base, list(base.blocks)))
    out = {}
    for stage in (1, 2, 3):
        model = _Checkpointed(checkpointed=False)
        mine = train(ShardedDataParallel(model, stage=stage, units=list(model.blocks)))
        out[stage] = _largest_difference(mine, theirs)
    return out


def _largest_difference(mine: dict, theirs: dict) -> float:
    """Of this rank's rows, relative to each tensor's largest value."""
    return max((mine[n] - t).abs().max().item() / max(t.abs().max().item(), 1e-30) for n, t in theirs.items() if t.numel())


def _fully_shard_units(model: nn.Module, units: list[nn.Module]) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for unit in units:
        fully_shard(unit, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def run() -> dict:
    theirs = _train(_fully_shard(_gpt()))
    out = {"fully_shard": {k: v for k, v in theirs.items() if k != "local"}, "stages": {}}
    settings = {1: dict(bucket_cap_mb=0.01), 2: dict(bucket_cap_mb=0.01), 3: dict(prefetch=1)}
    for stage, kw in settings.items():
        base = _gpt()
        if stage == 3:
            kw = {**kw, "units": list(base.layers)}
        ours = ShardedDataParallel(base, stage=stage, **kw)
        rep = _representation(ours, _fully_shard(_gpt()), _gpt()) if stage == 3 else None
        mine = _train(ours)
        diff = {n: (mine["local"][n] - theirs["local"][n]).abs().max().item() /
                max(theirs["local"][n].abs().max().item(), 1e-30) if theirs["local"][n].numel() else 0.0
                for n in theirs["local"]}
        full = ours.full_state_dict()
        out["stages"][stage] = {
            "norms": mine["norms"], "scales": mine["scales"], "losses": mine["losses"],
            "scaled_diff": max(diff.values()), "exact": all(torch.equal(mine["local"][n], theirs["local"][n])
                                                           for n in theirs["local"]),
            "representation": rep,
            "tied_in_state_dict": torch.equal(full["head.weight"], full["tok.weight"]),
        }
    out["optimizer_rule"] = _optimizer_rule()
    out["checkpointing"] = _checkpointing()
    out["optimizer_in_backward"] = _optimizer_in_backward()
    return out
