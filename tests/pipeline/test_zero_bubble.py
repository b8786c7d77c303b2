"""Any schedule on Gloo ranks: zero-bubble, user lists, torch's orders, memory, unusual models.

Two spawns: world 2 runs every check below and returns a dict per rank; world 3 runs the
zero-bubble schedules and a torch order with m not a multiple of p. The asserts are here in the
parent; the oracle is the unpartitioned model (and torch.distributed.pipelining's ZBV schedule).
"""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import commlab
from commlab.pipeline import PipelineExecutor, RankStages, from_csv, v_shape
from tests.support.pipeline_torch_orders import torch_csv

pytestmark = pytest.mark.slow  # every test here starts processes

BATCH = 10  # uneven micro-batches: 3, 3, 2, 2 for m = 4
CASES2 = [  # name, schedule, balance, placement, checkpoint, micro-batches
    ("zb-h1", "zb-h1", [4, 4], None, "never", 4),
    ("zb-h1 always", "zb-h1", [3, 5], None, "always", 4),
    ("zb-h1 except_last", "zb-h1", [5, 3], None, "except_last", 4),
    ("zb-v", "zb-v", [2, 2, 2, 2], "v", "never", 4),
    ("zb-v always", "zb-v", [2, 2, 2, 2], "v", "always", 4),
    ("torch LoopedBFS m=3", ("ScheduleLoopedBFS", [0, 2]), [2, 2, 2, 2], None, "never", 3),
    ("torch Interleaved1F1B m=3", ("ScheduleInterleaved1F1B", [0, 2]), [2, 2, 2, 2], None, "never", 3),
    ("torch ZBV", ("ScheduleZBVZeroBubble", [0, 3]), [2, 2, 2, 2], "v", "never", 4),
    ("torch InterleavedZeroBubble", ("ScheduleInterleavedZeroBubble", [0, 2]), [2, 2, 2, 2], None, "except_last", 4),
    ("hand-written", [["0F0", "0F1", "0F2", "0F3", "0B3", "0B2", "0B1", "0B0"],
                      ["1F0", "1B0", "1F1", "1F2", "1B2", "1B1", "1F3", "1B3"]], [4, 4], None, "never", 4),
]  # fmt: skip
CASES3 = [
    ("zb-h1", "zb-h1", [3, 3, 2], None, "never", 4),
    ("zb-v", "zb-v", [1, 2, 1, 1, 2, 1], "v", "always", 5),
    ("torch Interleaved1F1B m=4", ("ScheduleInterleaved1F1B", [0, 3]), [1, 2, 1, 1, 2, 1], None, "never", 4),
]


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(12, 24), nn.ReLU(), nn.Linear(24, 24), nn.Tanh(),
        nn.Linear(24, 24), nn.ReLU(), nn.Linear(24, 16), nn.Linear(16, 5),
    )


def _data(batch: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, 12, generator=g), torch.randint(0, 5, (batch,), generator=g)


def _grads(model: nn.Module) -> dict:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _schedule(schedule, ranks, m, stages):
    if isinstance(schedule, tuple):  # an order made by torch's own schedule code, through its CSV
        name, indices = schedule
        return from_csv(torch_csv(name, ranks, m, indices, stages))
    return schedule


def _step(model, balance, schedule, placement, checkpoint, m, x, y, **options):
    ranks = dist.get_world_size()
    stage = RankStages(model, balance, v_shape(ranks) if placement == "v" else None)
    pipe = PipelineExecutor(stage, _schedule(schedule, ranks, m, len(balance)), microbatches=m,
                            loss_fn=options.pop("loss_fn", F.cross_entropy), checkpoint=checkpoint, timeout=60, **options)  # fmt: skip
    loss = pipe.step(x if stage.is_first else None, target=y if stage.is_last else None)
    return None if loss is None else loss.item(), pipe


def _cases(cases, batch=BATCH):
    out = {}
    x, y = _data(batch)
    for name, schedule, balance, placement, checkpoint, m in cases:
        model = _model()
        loss, _ = _step(model, balance, schedule, placement, checkpoint, m, x, y)
        out[name] = (loss, _grads(model))
    return out


def _torch_zbv(x, y):
    from torch.distributed.pipelining import PipelineStage, ScheduleZBVZeroBubble

    from commlab.pipeline import split

    model, rank = _model(), dist.get_rank()
    parts = split(model, [2, 2, 2, 2])
    stages = [PipelineStage(parts[s], s, 4, torch.device("cpu")) for s in (rank, 3 - rank)]
    losses: list = []
    sched = ScheduleZBVZeroBubble(stages, 4, loss_fn=F.cross_entropy)
    sched.step(x, target=y, losses=losses) if rank == 0 else sched.step()
    return (torch.stack(losses).mean().item() if losses else None), _grads(model)


class AddOne(nn.Module):
    """A parameter-free stage whose output is whole numbers: token ids for the next stage."""

    def forward(self, x):
        return (x + 1) % 50


def _token_model():
    torch.manual_seed(0)
    return nn.Sequential(AddOne(), nn.Embedding(50, 8), nn.Flatten(), nn.Linear(24, 5))


def _bn_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 5))


def _unusual():
    out = {}
    x, y = _data(BATCH)
    # A parameter-free first stage (Dropout(0) and an activation), under 1F1B and zb-h1.
    for schedule in ("1f1b", "zb-h1"):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Dropout(0.0), nn.Tanh(), nn.Linear(12, 24), nn.ReLU(), nn.Linear(24, 5))
        out[("param-free", schedule)] = (_step(model, [2, 3], schedule, None, "always", 4, x, y)[0], _grads(model))
    # Token ids cross the boundary into an Embedding.
    tokens = torch.randint(0, 50, (BATCH, 3), generator=torch.Generator().manual_seed(2))
    for schedule in ("gpipe", "zb-h1"):
        model = _token_model()
        out[("tokens", schedule)] = (_step(model, [1, 3], schedule, None, "never", 4, tokens, y)[0], _grads(model))
    # reduction='sum' with loss_reduction="sum": gradients of the summed loss.
    model = _model()
    sum_ce = lambda out, t: F.cross_entropy(out, t, reduction="sum")  # noqa: E731
    out["sum"] = (_step(model, [4, 4], "1f1b", None, "never", 4, x, y, loss_fn=sum_ce, loss_reduction="sum")[0], _grads(model))
    # BatchNorm under recomputation: running statistics updated once per micro-batch.
    model = _bn_model()
    out["bn"] = (_step(model, [2, 2], "1f1b", None, "always", 4, x, y)[0], _grads(model),
                 model[1].running_mean.clone(), int(model[1].num_batches_tracked))  # fmt: skip
    # Memory: 1F1B's per-rank peak at m = 8 is well under GPipe's; hooks can be switched off.
    wide = nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))
    xw, yw = torch.randn(128, 256), torch.randint(0, 10, (128,))
    for schedule in ("gpipe", "1f1b", "zb-h1"):
        _, pipe = _step(wide, [2, 3], schedule, None, "never", 8, xw, yw)
        out[("memory", schedule)] = (pipe.memory.peak, dict(pipe.memory.peak_by_kind))
    wide.zero_grad()
    _, pipe = _step(wide, [2, 3], "1f1b", None, "never", 8, xw, yw, track_memory=False)
    out["untracked"] = (pipe.memory, pipe.peak_saved_bytes)
    return out


class Pool(nn.Module):
    """Mean over the sequence dimension: the model accepts any sequence length."""

    def forward(self, x):
        return x.mean(dim=1)


def _seq_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 24), nn.ReLU(), nn.Linear(24, 24), Pool(), nn.Linear(24, 5))


def _seq_data():
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(10, 3, 12, generator=g), torch.randint(0, 5, (10,), generator=g)),
            (torch.randn(7, 5, 12, generator=g), torch.randint(0, 5, (7,), generator=g))]  # fmt: skip


def _shapes_and_refusals():
    out = {}
    # Any dimension may change between steps: sequence length 3 then 5, batch 10 then 7.
    model = _seq_model()
    stage = RankStages(model, [2, 3])
    pipe = PipelineExecutor(stage, "zb-h1", microbatches=4, loss_fn=F.cross_entropy, timeout=60)
    losses = [pipe.step(x if stage.is_first else None, target=y if stage.is_last else None) for x, y in _seq_data()]
    out["seq"] = (None if losses[0] is None else [v.item() for v in losses], _grads(model))
    # Refusals reach every rank through the handshake, before any activation is sent.
    errors = {}
    x, y = _data(BATCH)
    pipe = PipelineExecutor(RankStages(_model(), [4, 4]), "1f1b", microbatches=4, loss_fn=F.cross_entropy, timeout=60)
    for case, (xi, yi) in {"no target": (x, None), "small batch": (x[:3], y[:3])}.items():
        try:
            pipe.step(xi if dist.get_rank() == 0 else None, target=yi)
        except ValueError as err:
            errors[case] = str(err)
    out["errors"] = errors
    return out


def _two_ranks():
    x8, y8 = _data(8)
    return {"cases": _cases(CASES2), "torch zbv": _torch_zbv(x8, y8), "ours zbv": _cases([("zbv8", "zb-v", [2, 2, 2, 2], "v", "never", 4)], 8),
            "unusual": _unusual(), "shapes": _shapes_and_refusals()}  # fmt: skip


def _three_ranks():
    return {"cases": _cases(CASES3)}


@pytest.fixture(scope="module")
def two_ranks():
    return commlab.launch(_two_ranks, world_size=2, backend="gloo", timeout=240)


@pytest.fixture(scope="module")
def three_ranks():
    return commlab.launch(_three_ranks, world_size=3, backend="gloo", timeout=240)


def _merged(results, *keys):
    loss, grads = None, {}
    for r in results:
        value = r
        for k in keys:
            value = value[k]
        loss = value[0] if value[0] is not None else loss
        grads.update(value[1])
    return loss, grads


def _reference(model, x, y, loss_fn=F.cross_entropy):
    loss = loss_fn(model(x), y)
    loss.backward()
    return loss.item(), _grads(model)


def _assert_equal(got, ref):
    loss, grads = got
    assert loss == pytest.approx(ref[0], rel=1e-5)
    assert set(grads) == set(ref[1])
    for name, g in ref[1].items():
        torch.testing.assert_close(grads[name], g, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("name", [c[0] for c in CASES2])
def test_world2_schedules_match_unpartitioned_model(two_ranks, name):
    _assert_equal(_merged(two_ranks, "cases", name), _reference(_model(), *_data(BATCH)))


@pytest.mark.parametrize("name", [c[0] for c in CASES3])
def test_world3_schedules_match_unpartitioned_model(three_ranks, name):
    _assert_equal(_merged(three_ranks, "cases", name), _reference(_model(), *_data(BATCH)))


def test_zbv_matches_torch_zbv(two_ranks):
    ours, theirs = _merged(two_ranks, "ours zbv", "zbv8"), _merged(two_ranks, "torch zbv")
    _assert_equal(ours, theirs)


def test_parameter_free_stage_and_token_ids(two_ranks):
    x, y = _data(BATCH)
    for schedule in ("1f1b", "zb-h1"):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Dropout(0.0), nn.Tanh(), nn.Linear(12, 24), nn.ReLU(), nn.Linear(24, 5))
        _assert_equal(_merged(two_ranks, "unusual", ("param-free", schedule)), _reference(model, x, y))
    tokens = torch.randint(0, 50, (BATCH, 3), generator=torch.Generator().manual_seed(2))
    for schedule in ("gpipe", "zb-h1"):
        _assert_equal(_merged(two_ranks, "unusual", ("tokens", schedule)), _reference(_token_model(), tokens, y))


def test_sum_reduction_is_not_rescaled(two_ranks):
    ref = _reference(_model(), *_data(BATCH), loss_fn=lambda o, t: F.cross_entropy(o, t, reduction="sum"))
    _assert_equal(_merged(two_ranks, "unusual", "sum"), ref)


def test_batchnorm_statistics_updated_once_per_microbatch_under_recomputation(two_ranks):
    # Reference: the whole model on each micro-batch in turn, loss weighted by its share.
    model, (x, y) = _bn_model(), _data(BATCH)
    total = 0.0
    for xi, yi in zip(torch.tensor_split(x, 4), torch.tensor_split(y, 4)):
        loss = F.cross_entropy(model(xi), yi) * len(xi) / BATCH
        loss.backward()
        total += loss.item()
    got = two_ranks[0]["unusual"]["bn"]
    torch.testing.assert_close(got[2], model[1].running_mean)
    assert got[3] == 4 == int(model[1].num_batches_tracked)  # not 8: the recomputation left them alone
    _assert_equal(_merged(two_ranks, "unusual", "bn")[:2], (total, _grads(model)))


def test_1f1b_rank_peak_is_well_under_gpipe_at_m8(two_ranks):
    for r in two_ranks:
        gpipe, one_f, zb = (r["unusual"][("memory", s)][0] for s in ("gpipe", "1f1b", "zb-h1"))
        # GPipe holds 8 micro-batches on each rank, 1F1B at most 2; sends are released early.
        assert one_f < 0.5 * gpipe, (one_f, gpipe)
        assert zb < 0.5 * gpipe
    kinds = two_ranks[0]["unusual"][("memory", "gpipe")][1]
    assert kinds["stash"] > 0
    assert two_ranks[0]["unusual"]["untracked"] == (None, {0: 0})  # no ledger, nothing counted


def test_shapes_may_change_between_steps(two_ranks):
    model = _seq_model()
    losses = []
    for x, y in _seq_data():
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        losses.append(loss.item())
    got = _merged(two_ranks, "shapes", "seq")
    assert got[0] == pytest.approx(losses, rel=1e-5)
    for name, g in _grads(model).items():
        torch.testing.assert_close(got[1][name], g, rtol=1e-5, atol=1e-6, msg=name)


def test_refusals_raise_on_every_rank(two_ranks):
    first, last = (r["shapes"]["errors"] for r in two_ranks)
    assert "last stage must pass target" in first["no target"] and "last stage must pass target" in last["no target"]
    assert "cannot be split into 4 micro-batches" in first["small batch"] and "cannot be split" in last["small batch"]
