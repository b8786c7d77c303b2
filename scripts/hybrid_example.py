"""Hybrid pipeline x data parallel: 2 stages x 2 replicas on 4 Gloo ranks.

Each replica trains on its half of the batch; each stage's two copies are kept in sync by
commlab.DistributedDataParallel over their data-parallel group, once per mini-batch.

    python scripts/hybrid_example.py
"""

import torch
import torch.nn.functional as F
from torch import nn

import commlab
from commlab.pipeline import DataParallelStage, PipelineExecutor


def make_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))


def hybrid_step():
    topo = commlab.Topology.build(pp=2, dp=2)  # collective: every rank builds every group
    model = make_model()
    stage = DataParallelStage(model, [2, 3], topo, bucket_cap_mb=1)
    pipe = PipelineExecutor(stage, "1f1b", microbatches=4, loss_fn=F.cross_entropy)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(64, 32, generator=g), torch.randint(0, 10, (64,), generator=g)
    mine = slice(32 * topo.replica, 32 * (topo.replica + 1))  # this replica's half
    loss = pipe.step(x[mine] if stage.is_first else None, target=y[mine] if stage.is_last else None)
    opt = torch.optim.SGD(stage.parameters(), lr=0.1)
    opt.step()  # replicas stay identical: they applied the same averaged gradients
    weights = torch.cat([p.detach().flatten() for p in stage.parameters()])
    return topo.stage, topo.replica, None if loss is None else loss.item(), weights


if __name__ == "__main__":
    out = commlab.launch(hybrid_step, world_size=4, backend="gloo", timeout=120)
    for stage in (0, 1):
        a, b = [w for s, _, _, w in out if s == stage]
        print(f"stage {stage}: replicas identical after the step: {torch.equal(a, b)}")
    print("per-replica losses on the last stage:", [round(loss, 6) for s, _, loss, _ in out if s == 1])
