"""Rank side of tests/sharded/test_checkpoint.py: save through torch.distributed.checkpoint at one
world size, stage and bucket size, resume at another, and train on as if never stopped.

Every step uses one global batch of 12 rows (the same at any world size; each rank takes its
slice), so the averaged gradient is the global batch's at every world size and a resumed run can
be compared with an uninterrupted one.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from commlab.sharded import ShardedDataParallel
from tests.support.sharded_models import Net

ROWS = 12
SAVED_AT = 5  # steps before the checkpoint
STEPS = 10


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    x, y = torch.randn(ROWS, 6, generator=g), torch.randn(ROWS, 3, generator=g)
    rank, world = dist.get_rank(), dist.get_world_size()
    rows = slice(rank * ROWS // world, (rank + 1) * ROWS // world)
    return x[rows], y[rows]


def _wrapped(seed: int, stage: int, bucket_mb: float) -> tuple[ShardedDataParallel, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    sharded = ShardedDataParallel(Net(), stage=stage, bucket_cap_mb=bucket_mb)
    return sharded, torch.optim.SGD(sharded.parameters(), lr=0.05, momentum=0.9)


def _train(sharded, opt, steps: range) -> None:
    for step in steps:
        nn.functional.mse_loss(sharded(_batch(step)[0]), _batch(step)[1]).backward()
        opt.step()
        opt.zero_grad()


def save(path: str, stage: int, bucket_mb: float) -> dict:
    """SAVED_AT steps from seed 0's model, then a sharded checkpoint; what each rank wrote."""
    sharded, opt = _wrapped(0, stage, bucket_mb)
    _train(sharded, opt, range(SAVED_AT))
    model_sd, optim_sd = get_state_dict(sharded, opt)
    locals_ = {k: v.to_local().clone() for k, v in model_sd.items() if hasattr(v, "to_local")}
    gathered_before = [b.gathered for b in sharded.buckets]
    gathers = _count_gathers(sharded)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    return {"dtensors": len(locals_), "entries": len(model_sd), "locals": locals_,
            "gathered": gathered_before + [b.gathered for b in sharded.buckets], "gathers_while_saving": gathers[0],
            "files": sorted(p.name for p in Path(path).iterdir())}


def _count_gathers(sharded: ShardedDataParallel) -> list[int]:
    """A counter of the all-gathers the wrapper's buckets start from now on."""
    count = [0]
    for bucket in sharded.buckets:
        def counted(*args, _start=bucket.launch_gather, **kwargs):
            count[0] += 1
            return _start(*args, **kwargs)
        bucket.launch_gather = counted
    return count


def resume(path: str, stage: int, bucket_mb: float) -> dict:
    """The uninterrupted run and the resumed one (another seed's model, loaded), STEPS in all."""
    reference, ref_opt = _wrapped(0, stage, bucket_mb)
    _train(reference, ref_opt, range(STEPS))
    expected = reference.full_state_dict()
    sharded, opt = _wrapped(7, stage, bucket_mb)
    model_sd, optim_sd = get_state_dict(sharded, opt)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(sharded, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    _train(sharded, opt, range(SAVED_AT, STEPS))
    got = sharded.full_state_dict()
    scaled = {k: ((got[k] - expected[k]).abs().max() / expected[k].abs().max().clamp_min(1e-30)).item() for k in expected}
    return {"keys": sorted(got) == sorted(expected), "scaled": scaled, "buckets": len(sharded.buckets)}
