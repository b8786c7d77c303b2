"""A 1F1B pipeline over 2 Gloo ranks, checked against the unpartitioned model.

    python scripts/pipeline_example.py
"""

import torch
import torch.nn.functional as F
from torch import nn

import commlab
from commlab.pipeline import PipelineExecutor, RankStages, balance_by_size


def make_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))


def batch():
    g = torch.Generator().manual_seed(1)
    return torch.randn(64, 32, generator=g), torch.randint(0, 10, (64,), generator=g)


def train_step(balance):
    model = make_model()
    stage = RankStages(model, balance)  # this rank's part; the other layers stay unused here
    pipe = PipelineExecutor(stage, "1f1b", microbatches=8, loss_fn=F.cross_entropy, checkpoint="except_last")
    x, y = batch()
    loss = pipe.step(x if stage.is_first else None, target=y if stage.is_last else None)
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    return (None if loss is None else loss.item()), grads, pipe.peak_saved_bytes


if __name__ == "__main__":
    balance = balance_by_size(make_model(), batch()[0][:8], 2)  # decided once, before launching
    ranks = commlab.launch(train_step, balance, world_size=2, backend="gloo", timeout=120)
    model = make_model()
    x, y = batch()
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    worst = max((ranks[r][1][n] - p.grad).abs().max().item() for n, p in model.named_parameters() for r in (0, 1) if n in ranks[r][1])
    print(f"balance {balance}; pipeline loss {ranks[1][0]:.6f}, unpartitioned {loss.item():.6f}; max |grad diff| {worst:.1e}")
    print(f"activation bytes at peak, stage 0: {ranks[0][2][0]}, stage 1: {ranks[1][2][1]}")
