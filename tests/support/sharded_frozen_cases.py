"""Rank-side code of the frozen-parameter test: a LoRA-style model (frozen embedding, frozen base
layers and norms, trainable low-rank adapters and head) trained with SGD with momentum by commlab
at stage 3 and by torch's ``fully_shard`` on the same units; plain data goes back to the parent."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import DTensor

from commlab.sharded import ShardedDataParallel
from examples.lora import Adapted

VOCAB, WIDTH, RANK, DEPTH, STEPS = 32, 48, 4, 6, 4


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH).requires_grad_(False)
        self.mix = Adapted(WIDTH, RANK)

    def forward(self, x):
        return x + torch.tanh(self.mix(self.norm(x)))


class Tuned(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH).requires_grad_(False)
        self.blocks = nn.ModuleList(Block() for _ in range(DEPTH))
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _model(checkpointed: bool = False) -> Tuned:
    torch.manual_seed(0)  # fully_shard does not broadcast: every rank builds the same values
    model = Tuned()
    if checkpointed:  # recomputed in backward: the wrapper runs the block inside it, not itself
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

        model.blocks = nn.ModuleList(checkpoint_wrapper(block) for block in model.blocks)
    return model


def _train(model: nn.Module, steps: int = STEPS) -> dict:
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)  # the frozen ones too: no .grad
    losses = []
    for step in range(steps):
        g = torch.Generator().manual_seed(100 * dist.get_rank() + step)
        tokens = torch.randint(0, VOCAB, (4, 9), generator=g)
        loss = nn.functional.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "local": {n: p.to_local().detach().clone() for n, p in model.named_parameters()}}


def _fully_shard(policy=None, checkpointed: bool = False) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = _model(checkpointed)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    kw = {"mp_policy": policy} if policy is not None else {}
    for block in model.blocks:
        fully_shard(block, mesh=mesh, **kw)
    return fully_shard(model, mesh=mesh, **kw)


BF16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def _dcp_round_trip(path: str) -> bool:
    """Saved by torch.distributed.checkpoint from units, the frozen weights scaled after wrapping,
    and loaded into size buckets: every tensor back as saved, the frozen shards too."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    base = _model()
    saved = ShardedDataParallel(base, stage=3, units=list(base.blocks))
    _train(saved, steps=2)
    with torch.no_grad():
        for p in saved.parameters():
            if not p.requires_grad:
                p.mul_(1.5)
    dcp.save({"model": get_model_state_dict(saved)}, checkpoint_id=path)
    torch.manual_seed(1)  # other values (construction broadcasts rank 0's)
    loaded = ShardedDataParallel(Tuned(), stage=3, bucket_cap_mb=0.01)
    state = {"model": get_model_state_dict(loaded)}
    dcp.load(state, checkpoint_id=path)
    set_model_state_dict(loaded, state["model"])
    want, got = saved.full_state_dict(), loaded.full_state_dict()
    return want.keys() == got.keys() and all(torch.equal(got[k], want[k]) for k in want)


def run(path: str) -> dict:
    oracle = {(False, False): _train(_fully_shard()), (True, False): _train(_fully_shard(BF16)),
              (False, True): _train(_fully_shard(checkpointed=True))}
    out = {"cases": {}, "dcp": _dcp_round_trip(path)}
    for name, kw in {"units": {"units": None}, "units-prefetch0": {"units": None, "prefetch": 0},
                     "policy": {"bucket_cap_mb": 0.01}, "units-no-reshard": {"units": None, "reshard_after_forward": False},
                     "ring": {"units": None, "algorithm": "ring"}, "bf16": {"units": None, "mixed_precision": BF16},
                     "checkpointed": {"units": None, "checkpointed": True}}.items():
        kw = dict(kw)
        checkpointed = kw.pop("checkpointed", False)
        theirs = oracle[("mixed_precision" in kw, checkpointed)]
        base = _model(checkpointed)
        original = {n: p.detach().clone() for n, p in base.named_parameters()}
        if "units" in kw:
            kw = {**kw, "units": list(base.blocks)}
        ours = ShardedDataParallel(base, stage=3, **kw)
        frozen = {n for n, p in ours.named_parameters() if not p.requires_grad}
        mine = _train(ours)
        held = ours.memory()
        full = ours.full_state_dict()  # gathered: the frozen values whole, as built
        out["cases"][name] = {
            "losses": mine["losses"] == theirs["losses"],
            "largest_difference": max((mine["local"][n] - t).abs().max().item() for n, t in theirs["local"].items() if t.numel()),
            "frozen": sorted(n.replace("_checkpoint_wrapped_module.", "") for n in frozen),
            "dtensors": all(isinstance(p, DTensor) for p in ours.parameters()),
            "frozen_unchanged": all(torch.equal(mine["local"][n], _rows(original[n])) for n in frozen),
            "replicated": held.replicated,
            "peak_gathered": held.peak_gathered,
            "frozen_buckets": sum(not b.trains for b in ours.buckets),
            "gathered_bound": _bound(ours, base),
            # (state dict keys leave checkpoint_wrapper's prefix out, parameter names keep it)
            "full_frozen": all(torch.equal(full[n.replace("_checkpoint_wrapped_module.", "")], original[n])
                               for n in frozen),
        }
    return out


def _bound(ours: ShardedDataParallel, base: Tuned) -> int:
    """What stage 3 may hold gathered at once if each block's buckets go after its backward: the
    prefetch window of blocks (one block's buckets, frozen and trained, the largest) plus the
    largest bucket outside the blocks (embedding or head)."""
    per_block, inside = [], set()
    for block in base.blocks:
        wholes = {id(ours.whole_of(p)) for p in block.parameters()}
        inside |= wholes
        per_block.append(sum(b.full_nbytes for b in ours.buckets if any(id(p) in wholes for p in b.params)))
    rest = [b.full_nbytes for b in ours.buckets if not any(id(p) in inside for p in b.params)]
    return (ours.prefetch + 1) * max(per_block) + max(rest, default=0)


def _rows(full: torch.Tensor) -> torch.Tensor:
    chunks = torch.chunk(full, dist.get_world_size())
    return chunks[dist.get_rank()] if dist.get_rank() < len(chunks) else full[:0]
