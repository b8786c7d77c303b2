"""A LoRA-style model (Hu et al. 2021: a frozen Linear plus a trainable low-rank update), and the
memory of stage 3 on it against fully_shard.

``python examples/lora.py [commlab|fully_shard]``: 8 residual blocks of a frozen Linear(512, 512)
with a rank-8 update, a trainable head, Adam over the trainable parameters, 2 Gloo ranks; prints,
per rank, the bytes held between steps and the peak of a step (commlab.memtrack: live bytes at the
step's start plus its allocations' highest point; the lowest of 3 steps), commlab at stage 3 with
one unit per block, or torch's fully_shard on the same blocks.
"""

import gc
import sys

import torch
import torch.distributed as dist
from torch import nn

import commlab
from commlab.memtrack import live_bytes, track_peak

WIDTH, RANK, DEPTH = 512, 8, 8


class Adapted(nn.Module):
    """A frozen ``Linear(width, width)`` plus a trainable update through ``rank`` features."""

    def __init__(self, width: int, rank: int):
        super().__init__()
        self.base = nn.Linear(width, width).requires_grad_(False)
        self.down, self.up = nn.Linear(width, rank, bias=False), nn.Linear(rank, width, bias=False)

    def forward(self, x):
        return self.base(x) + self.up(self.down(x))


class Residual(nn.Module):
    def __init__(self, width: int, rank: int):
        super().__init__()
        self.mix = Adapted(width, rank)

    def forward(self, x):
        return x + torch.tanh(self.mix(x))


def wrap(model: nn.Sequential, impl: str) -> nn.Module:
    blocks = list(model)[:-1]
    if impl == "commlab":
        return commlab.ShardedDataParallel(model, stage=3, units=blocks, prefetch=1, algorithm="native")
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for block in blocks:
        fully_shard(block, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def run(impl: str) -> dict:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = wrap(nn.Sequential(*[Residual(WIDTH, RANK) for _ in range(DEPTH)], nn.Linear(WIDTH, 10)), impl)
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    x = torch.randn(16, WIDTH, generator=torch.Generator().manual_seed(dist.get_rank()))
    y = torch.randint(0, 10, (16,))

    def step():
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()

    step()  # Adam's state exists from here on
    gc.collect()
    peaks = []
    for _ in range(3):
        with track_peak("cpu"):
            step()  # makes the blocks the measured step frees known (commlab/memtrack.py)
        held = live_bytes()
        with track_peak("cpu") as peak:
            step()
        peaks.append(held + peak.peak_bytes)
    return {"held_mib": round(held / 2**20, 2), "peak_mib": round(min(peaks) / 2**20, 2)}


if __name__ == "__main__":
    impl = sys.argv[1] if len(sys.argv) > 1 else "commlab"
    if impl not in ("commlab", "fully_shard"):
        raise SystemExit(f"usage: python examples/lora.py [commlab|fully_shard], not {impl!r}")
    print(impl, commlab.launch(run, impl, world_size=2, backend="gloo", timeout=300))
