"""Rank-side code of the hybrid sharding test (world size 4, a 2 x 2 (replicate, shard) grid):
commlab's HSDP beside torch's DDP and torch's fully_shard HSDP, returning plain data."""

from __future__ import annotations


import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from commlab.runtime.topology import Topology
from commlab.sharded import ShardedDataParallel
from commlab.sharded.memory_model import zero_memory
from tests.support.helpers import error_of
from tests.support.sharded_models import Net

STEPS, LR = 6, 0.05
SPLIT_MB = 200 / (1024 * 1024)  # 3 buckets of Net's 134 parameters


def _data(step: int):
    g = torch.Generator().manual_seed(1000 * dist.get_rank() + step)  # every rank its own batch
    return torch.randn(4, 6, generator=g), torch.randn(4, 3, generator=g)


def _train(model, params, lr: float = LR) -> list[float]:
    """SGD with momentum; returns the total gradient norm of each step (clip_grad_norm_'s)."""
    opt = torch.optim.SGD(params, lr=lr, momentum=0.9)
    norms = []
    for step in range(STEPS):
        x, y = _data(step)
        nn.functional.mse_loss(model(x), y).backward()
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm=1e9)
        norms.append((norm.full_tensor() if isinstance(norm, DTensor) else norm).item())
        opt.step()
        opt.zero_grad()
    return norms


def _scaled(ours: dict, theirs: dict) -> float:
    """Largest difference relative to each tensor's largest value."""
    assert ours.keys() == theirs.keys(), (sorted(ours), sorted(theirs))
    return max(((ours[k] - theirs[k]).abs().max() / theirs[k].abs().max()).item() for k in ours)


def _ddp(lr: float = LR) -> tuple[dict, list[float]]:
    torch.manual_seed(dist.get_rank())  # ranks start different: DDP broadcasts rank 0's
    ddp = TorchDDP(Net(), broadcast_buffers=False)
    norms = _train(ddp, list(ddp.parameters()), lr)
    return ddp.module.state_dict(), norms


def _ours(topo: Topology, stage: int, hybrid: bool = True, **kw) -> tuple[ShardedDataParallel, list[float]]:
    torch.manual_seed(dist.get_rank())  # ranks start different: construction must broadcast over both groups
    ours = ShardedDataParallel(Net(), stage=stage, process_group=topo.shard_group,
                               replicate_group=topo.replicate_group if hybrid else None, **kw)
    return ours, _train(ours, list(ours.parameters()))


def _collectives(ours: ShardedDataParallel) -> dict:
    last = ours.iteration_timings[-1].collectives
    kinds = {kind: sorted(c.nbytes for c in last if c.kind == kind) for kind in sorted({c.kind for c in last})}
    kinds["ordered_stamps"] = all(c.ready <= c.launched <= c.done for c in last)
    return kinds


def _fully_shard() -> dict:
    """torch's own HSDP: fully_shard on a (replicate, shard) mesh, one group per layer."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    torch.manual_seed(0)  # rank 0's initial values, which DDP and commlab start from
    model = Net()
    for layer in (model.a, model.b, model.head):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    _train(model, list(model.parameters()))
    return {k: v.full_tensor() for k, v in model.state_dict().items()}


def _checkpoint(ours: ShardedDataParallel, saved: dict, path: str) -> dict:
    """DCP round trip of HSDP's (Replicate(), Shard(0)) state dict: back into the same wrapper after
    its shards changed, and resharded into a plain 4-way one."""
    dcp.save(ours.state_dict(), checkpoint_id=path)
    with torch.no_grad():
        for p in ours.parameters():
            p.to_local().add_(1.0)
    state = ours.state_dict()
    dcp.load(state, checkpoint_id=path)
    ours.load_state_dict(state)
    plain = ShardedDataParallel(Net(), stage=3)  # Shard(0) over all 4 ranks
    state = plain.state_dict()
    dcp.load(state, checkpoint_id=path)
    plain.load_state_dict(state)
    return {"same": _scaled(ours.full_state_dict(), saved) == 0.0,
            "resharded": _scaled(plain.full_state_dict(), saved) == 0.0}


def run(path: str) -> dict:
    rank = dist.get_rank()
    topo = Topology.build(dp=4, shard=2)
    plain = Topology.build(dp=4)
    out: dict = {
        "groups": (topo.shard, topo.shard_ranks, topo.replicate_ranks,
                   dist.get_process_group_ranks(topo.shard_group), dist.get_process_group_ranks(topo.replicate_group)),
        "plain": (plain.shard, plain.replicate_group is None, plain.shard_group is plain.dp_group),
    }
    ref, ref_norms = _ddp()
    theirs_hsdp = _fully_shard()
    out["fully_shard"] = _scaled(theirs_hsdp, ref)
    cases = {}
    for stage, algorithm, cap in [(1, "ring", 25), (2, "ring", SPLIT_MB), (3, "ring", SPLIT_MB), (1, "native", SPLIT_MB),
                                  (2, "native", SPLIT_MB), (3, "native", 25), (3, "halving_doubling", SPLIT_MB)]:
        ours, norms = _ours(topo, stage, algorithm=algorithm, bucket_cap_mb=cap)
        full = ours.full_state_dict()
        opt = torch.optim.SGD(ours.parameters(), lr=LR, momentum=0.9)
        memory = ours.memory(opt)
        psi = sum(layout.total for layout in ours.layouts)
        cases[f"s{stage}-{algorithm}-{len(ours.layouts)}"] = {
            "scaled": _scaled(full, ref),
            "vs_fully_shard": _scaled(full, theirs_hsdp),
            "norm": max(abs(a - b) / b for a, b in zip(norms, ref_norms)),
            "collectives": _collectives(ours),
            # what the all-gathers and the shard group's reductions move: the buckets padded over 2 ranks
            "padded": sorted(layout.padded * 4 for layout in ours.layouts),
            "shards": sorted(layout.shard_size * 4 for layout in ours.layouts),
            "totals": sorted(layout.total * 4 for layout in ours.layouts),
            "layout_ranks": {layout.world_size for layout in ours.layouts},
            "placements": {str(p.placements) for p in ours.parameters()},
            "parameter_shards": memory.parameter_shards,
            "model_parameters": zero_memory(psi, 4, 3, "fp32", shard=2).parameters,
            "same_shards_as_replica": _same_across(ours, topo.replicate_group),
        }
        if stage == 3 and algorithm == "ring":
            out["checkpoint"] = _checkpoint(ours, full, path)
    out["cases"] = cases
    # Wrong variants the bound must catch: no reduction across replicas (each shard group trains on
    # its own half of the data, dividing by 2) and DDP's sum divided by 2 instead of 4 (twice the lr
    # is the same update for SGD with momentum from zero state).
    no_replicas, _ = _ours(topo, 3, hybrid=False)
    out["wrong"] = {"no_replicas": _scaled(no_replicas.full_state_dict(), ref), "divided_by_2": _scaled(_ddp(2 * LR)[0], ref)}
    out["refused"] = {
        "overlap": error_of(lambda: ShardedDataParallel(Net(), process_group=None, replicate_group=topo.replicate_group)),
        "same": error_of(lambda: ShardedDataParallel(Net(), process_group=topo.shard_group,
                                                     replicate_group=topo.shard_group)),
    }
    out["rank"] = rank
    return out


def _same_across(ours: ShardedDataParallel, group) -> bool:
    """Every rank of the replicate group holds the same shards (bit for bit)."""
    mine = torch.cat([p.to_local().detach().flatten() for p in ours.parameters()])
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(everyone, mine, group=group)
    return all(torch.equal(everyone[0], t) for t in everyone)
