"""Rank-side code of tests/bench/test_fsdp_comms.py: fully_shard's custom collectives on commlab's
ring beside Gloo's own, as single calls and as a whole training run; plain data back to the parent."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from commlab.bench.fsdp_comms import P2PAllGather, P2PReduceScatter, use_p2p_collectives
from tests.support.helpers import error_of


def _scaled(a: torch.Tensor, b: torch.Tensor) -> float:
    """The largest difference over the largest magnitude (0 where both are zero)."""
    return ((a - b).abs().max() / max(a.abs().max(), 1e-30)).item()


def single_calls() -> dict:
    """Each custom collective against Gloo's on the same input: sum and avg, blocking and async,
    a padded odd size, and bad calls refused before any message."""
    world, rank, group = dist.get_world_size(), dist.get_rank(), dist.group.WORLD
    g = torch.Generator().manual_seed(7 + rank)
    out: dict = {}
    for n in (1, 1037, 300_000):  # elements per rank
        x = torch.randn(n * world, generator=g)
        for op, name in ((dist.ReduceOp.SUM, "sum"), (dist.ReduceOp.AVG, "avg")):
            for async_op in (False, True):
                want, got = torch.empty(n), torch.full((n,), float("nan"))
                dist.reduce_scatter_single(want, x.clone(), op=op)
                work = P2PReduceScatter("ring")(got, x.clone(), group, op, async_op=async_op)
                if async_op:
                    work.wait()
                out[f"rs-{name}-{n}-{'async' if async_op else 'sync'}"] = _scaled(want, got)
        shard = torch.randn(n, generator=g)
        for async_op in (False, True):
            want = torch.empty(n * world)
            got = P2PAllGather("ring").allocate((n * world,), dtype=torch.float32, device=torch.device("cpu"))
            got.fill_(float("nan"))
            dist.all_gather_single(want, shard)
            work = P2PAllGather("ring")(got, shard, group, async_op=async_op)
            if async_op:
                work.wait()
            out[f"ag-{n}-{'async' if async_op else 'sync'}"] = bool(torch.equal(want, got))
    out["bad_size"] = error_of(lambda: P2PReduceScatter("ring")(torch.empty(3), torch.empty(3 * world + 1), group))
    out["bad_op"] = error_of(lambda: P2PReduceScatter("ring")(torch.empty(3), torch.empty(3 * world), group,
                                                              dist._make_nccl_premul_sum(0.5)))
    out["bad_gather"] = error_of(lambda: P2PAllGather("ring")(torch.empty(3 * world + 1), torch.empty(3), group))
    dist.barrier()
    return out


def _trained(ring: bool) -> list[torch.Tensor]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 9), nn.ReLU(), nn.Linear(9, 5), nn.ReLU(), nn.Linear(5, 3))
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    if ring:
        use_p2p_collectives(model, "ring")
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(4):
        g = torch.Generator().manual_seed(100 * dist.get_rank() + step)
        x, y = torch.randn(4, 6, generator=g), torch.randn(4, 3, generator=g)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return [p.full_tensor().detach().clone() for p in model.parameters()]


def training() -> dict:
    """fully_shard with the ring collectives against fully_shard as is: 4 SGD steps with momentum."""
    ring, gloo = _trained(True), _trained(False)
    return {"params": len(ring), "scaled": max(_scaled(a, b) for a, b in zip(gloo, ring))}
