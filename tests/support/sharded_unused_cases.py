"""Rank-side code of tests/sharded/test_unused.py: parameters unused on some ranks or on all, and
uneven inputs under join(), every case in one spawn per world size, returning plain data."""

from __future__ import annotations

import copy
import warnings

import torch
import torch.distributed as dist
from torch import nn

from commlab.sharded import ShardedDataParallel
from tests.support.helpers import error_of

STEPS = 6
SKIPPED_AT = (1, 3)  # steps at which every rank skips ``Branchy.mid``


class Branchy(nn.Module):
    """Two outputs (the loss reads the first: ``side`` never gets a gradient) and a module ``mid``
    that a forward can skip."""

    def __init__(self):
        super().__init__()
        self.a, self.mid, self.b = nn.Linear(6, 9), nn.Linear(9, 9), nn.Linear(9, 5)
        self.side, self.head = nn.Linear(9, 4), nn.Linear(5, 3)

    def forward(self, x, skip: bool = False):
        h = torch.relu(self.a(x))
        if not skip:
            h = torch.tanh(self.mid(h))
        return self.head(torch.tanh(self.b(h))), self.side(h)


def _sgd(params):
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def _data(step: int):
    g = torch.Generator().manual_seed(1000 * dist.get_rank() + step)
    return torch.randn(4, 6, generator=g), torch.randn(4, 3, generator=g)


def _grads(model) -> dict[str, bool]:
    return {n: p.grad is not None for n, p in model.named_parameters()}


def _train(model, opt, skip_at=SKIPPED_AT, steps=STEPS, loss_reads_side=False) -> list[dict[str, bool]]:
    """Steps of SGD with momentum; for each, which parameters had a gradient at the step."""
    had = []
    for step in range(steps):
        x, y = _data(step)
        out, side = model(x, step in skip_at)
        loss = nn.functional.mse_loss(out, y) + (side.sum() if loss_reads_side else 0)
        loss.backward()
        had.append(_grads(model))
        opt.step()
        opt.zero_grad()
    return had


def _state(model) -> dict[str, torch.Tensor]:
    state = model.state_dict()
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone() for k, v in state.items()}


def against_fully_shard(stage: int) -> dict:
    """The same model, data and optimizer under torch's fully_shard on every module: which
    gradients are None at each step, and the parameters after the steps."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)  # fully_shard does not broadcast: every rank builds the same values
    base = Branchy()
    theirs = copy.deepcopy(base)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in (theirs.a, theirs.mid, theirs.b, theirs.side, theirs.head):
        fully_shard(layer, mesh=mesh)
    fully_shard(theirs, mesh=mesh)
    units = [base.a, base.mid, base.b, base.side, base.head] if stage == 3 else None
    ours = ShardedDataParallel(base, stage=stage, units=units)
    before = _state(ours.module)
    had_o, had_t = _train(ours, _sgd(ours.parameters())), _train(theirs, _sgd(theirs.parameters()))
    mine, ref = ours.full_state_dict(), _state(theirs)
    return {
        "grads_ours": had_o,
        "grads_torch": had_t,
        "scaled": max(((mine[k] - ref[k]).abs().max() / ref[k].abs().max()).item() for k in ref),
        "exact": all(torch.equal(mine[k], ref[k]) for k in ref),
        "side_untouched": all(torch.equal(mine[k], before[k]) for k in ("side.weight", "side.bias")),
        "mid_moved": not torch.equal(mine["mid.weight"], before["mid.weight"]),
    }


def partial(stage: int, kind: str, units: bool) -> str:
    """A parameter used on some ranks only: rank 0 skips ``mid`` (``kind="module"``) or its loss
    reads ``side`` (``kind="output"``). The error text of the first backward (every rank)."""
    torch.manual_seed(0)
    model = Branchy()
    chosen = [model.a, model.mid, model.b, model.side, model.head] if units else None
    ours = ShardedDataParallel(model, stage=stage, units=chosen, bucket_cap_mb=200 / 2**20)
    first = dist.get_rank() == 0
    skip_at = (0,) if kind == "module" and first else ()
    return error_of(lambda: _train(ours, _sgd(ours.parameters()), skip_at, 1, kind == "output" and first))


def joined(stage: int, batches: int | None) -> dict:
    """Inside join(): ``batches`` for rank 0 (None: the same 3 as every rank). With even inputs,
    the parameters against the same steps without join()."""
    runs = {}
    for use_join in (True, False):
        torch.manual_seed(0)
        model = Branchy()
        ours = ShardedDataParallel(model, stage=stage, bucket_cap_mb=200 / 2**20)
        opt = _sgd(ours.parameters())
        n = batches if batches is not None and dist.get_rank() == 0 else 3

        def loop():
            for step in range(n):
                x, y = _data(step)
                nn.functional.mse_loss(ours(x)[0], y).backward()
                opt.step()
                opt.zero_grad()

        if use_join:
            def with_join():
                with ours.join():
                    loop()
            runs["error"] = error_of(with_join)
        else:
            loop()
        runs[use_join] = ours.full_state_dict()
        if batches is not None:
            break
    out = {"error": runs["error"]}
    if batches is None:
        out["same"] = all(torch.equal(runs[True][k], runs[False][k]) for k in runs[True])
    return out


def run() -> dict:
    warnings.simplefilter("ignore", FutureWarning)
    result = {"partial": {}, "fully_shard": {}, "join": {}}
    for stage in (1, 2, 3):  # first: a hang here would show as the launch's timeout
        for kind in ("module", "output"):
            result["partial"][f"s{stage}-{kind}"] = partial(stage, kind, False)  # 200-byte buckets
        if stage == 3:
            for kind in ("module", "output"):
                result["partial"][f"s3-units-{kind}"] = partial(stage, kind, True)
    for stage in (1, 2, 3):
        result["fully_shard"][stage] = against_fully_shard(stage)
        result["join"][f"s{stage}-even"] = joined(stage, None)
        result["join"][f"s{stage}-uneven"] = joined(stage, 2)
    return result
