"""Hybrid pipeline x data parallel (2 x 2 on 4 Gloo ranks) equals the unpartitioned model.

Each data-parallel replica gets its own half of the mini-batch; after one step every rank's
gradients must equal the unpartitioned model's on the whole batch (DDP averages the two halves),
and each stage's DDP must have synchronised exactly once per mini-batch, not once per micro-batch.
One spawn checks gpipe, 1f1b and interleaved, one with checkpointing, the zero-bubble schedules
(whose split stages reduce once, after their last W), gradient accumulation over two steps with
one reduction, a GPT cut by name under zb-v with an attention mask, and the topology's groups.
"""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import commlab
from commlab.models import GPT, lm_loss
from commlab.pipeline import PipelineExecutor, v_shape
from commlab.pipeline.runtime.hybrid import DataParallelStage
from commlab.runtime.topology import grid

pytestmark = pytest.mark.slow  # every test here starts processes

CASES = [("gpipe", [4, 4], "never"), ("1f1b", [3, 5], "except_last"), ("interleaved", [2, 2, 2, 2], "never"),
         ("interleaved", [3, 1, 2, 2], "always"),  # stage 1 is a Tanh alone: no parameters, no DDP
         ("zb-h1", [3, 5], "except_last"), ("zb-v", [2, 2, 2, 2], "never")]
BATCH = 16  # 8 per replica, 4 micro-batches of 2


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 24), nn.ReLU(), nn.Linear(24, 24), nn.Tanh(), nn.Linear(24, 24), nn.ReLU(), nn.Linear(24, 16), nn.Linear(16, 5))


def _data(batch: int):
    g = torch.Generator().manual_seed(1)
    return torch.randn(batch, 12, generator=g), torch.randint(0, 5, (batch,), generator=g)


def _grads(model: nn.Module) -> dict:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _hybrid():
    topo = commlab.Topology.build(2, 2, timeout=100)
    out = {
        "pp_ranks": dist.get_process_group_ranks(topo.pp_group),
        "dp_ranks": dist.get_process_group_ranks(topo.dp_group),
        "coords": (topo.stage, topo.replica, topo.pp_ranks, topo.dp_ranks),
    }
    try:
        commlab.Topology.build(3, 2)
    except ValueError as err:
        out["bad_dims"] = str(err)
    x, y = _data(BATCH)
    half = slice(topo.replica * BATCH // 2, (topo.replica + 1) * BATCH // 2)
    for schedule, balance, checkpoint in CASES:
        model = _model()
        placement = v_shape(2) if schedule == "zb-v" else None
        stage = DataParallelStage(model, balance, topo, placement=placement, bucket_cap_mb=0.001)
        pipe = PipelineExecutor(stage, schedule, microbatches=4, loss_fn=F.cross_entropy, checkpoint=checkpoint, timeout=100)
        loss = pipe.step(x[half] if stage.is_first else None, target=y[half] if stage.is_last else None)
        out[_key(schedule, balance)] = (None if loss is None else loss.item(), _grads(model), _syncs(stage))
    # Gradient accumulation: two steps (each replica's half split in two), one reduction at the end.
    for schedule in ("1f1b", "zb-h1"):
        model = _model()
        stage = DataParallelStage(model, [3, 5], topo, bucket_cap_mb=0.001)
        pipe = PipelineExecutor(stage, schedule, microbatches=2, loss_fn=F.cross_entropy, timeout=100)
        quarters = [slice(half.start, half.start + BATCH // 4), slice(half.start + BATCH // 4, half.stop)]
        with stage.no_sync():
            pipe.step(x[quarters[0]] if stage.is_first else None, target=y[quarters[0]] if stage.is_last else None)
        out["accumulated " + schedule] = (_grads(model), _syncs(stage))
        pipe.step(x[quarters[1]] if stage.is_first else None, target=y[quarters[1]] if stage.is_last else None)
        out["accumulated " + schedule] = (*out["accumulated " + schedule], _grads(model), _syncs(stage))
    # Any module, cut by name: a GPT with an attention mask, zero bubble on the V.
    model, (tokens, mask, target) = _gpt(), _gpt_data()
    stage = DataParallelStage(model, None, topo, placement=v_shape(2), split_points=["layers.1", "layers.2", "layers.3"],
                              example_args=(tokens[:2],), example_kwargs={"attention_mask": mask[:2]})  # fmt: skip
    pipe = PipelineExecutor(stage, "zb-v", microbatches=4, loss_fn=lm_loss, timeout=100)
    rows = slice(topo.replica * 8, topo.replica * 8 + 8)
    inputs = ((tokens[rows],), {"attention_mask": mask[rows]}) if stage.is_first else ((), {})
    loss = pipe.step(*inputs[0], target=target[rows] if stage.is_last else None, **inputs[1])
    grads = {n: p.grad.clone() for n, p in stage.named_parameters()}
    out["gpt"] = (None if loss is None else loss.item(), grads, _syncs(stage))
    return out


def _gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(vocab=64, d_model=32, layers=4, heads=4, seq=16)


def _gpt_data():
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 64, (16, 16), generator=g)
    mask = torch.ones(16, 16)
    mask[::3, 11:] = 0
    return tokens, mask, torch.roll(tokens, -1, dims=1)


def _syncs(stage) -> dict:
    """Gradient reductions per stage module: DDP's own (one record per sync) plus the split stages'."""
    return {s: len(m.iteration_timings) + stage.reductions[s] for s, m in stage.modules.items()
            if hasattr(m, "iteration_timings")}  # fmt: skip


@pytest.fixture(scope="module")
def hybrid():
    return commlab.launch(_hybrid, world_size=4, backend="gloo", timeout=120)


def _at(stage: int, replica: int) -> int:
    return grid(2, 2)[stage][replica]


def test_topology_groups_follow_the_grid(hybrid):
    # grid = arange(4).view(pp=2, dp=2): row = stage, column = replica.
    # mesh = arange(4).view(dp=2, pp=2): each replica's pipeline is two consecutive ranks.
    assert [r["coords"] for r in hybrid] == [
        (0, 0, [0, 1], [0, 2]), (1, 0, [0, 1], [1, 3]), (0, 1, [2, 3], [0, 2]), (1, 1, [2, 3], [1, 3]),
    ]
    assert [r["pp_ranks"] for r in hybrid] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [r["dp_ranks"] for r in hybrid] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert all("2 x 2" not in r["bad_dims"] and "world has 4 ranks" in r["bad_dims"] for r in hybrid)


def _key(schedule, balance):
    return f"{schedule} {balance}"


@pytest.mark.parametrize("schedule", [_key(c[0], c[1]) for c in CASES])
def test_hybrid_matches_unpartitioned_model(hybrid, schedule):
    model = _model()
    x, y = _data(BATCH)
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    ref = _grads(model)
    # The last stage's ranks (2 and 3; 0 and 1 on the V) each return their half's loss; their
    # mean is the whole batch's.
    v = schedule.startswith("zb-v")
    last, others = [[_at(s, rep) for rep in (0, 1)] for s in ((0, 1) if v else (1, 0))]
    halves = [hybrid[r][schedule][0] for r in last]
    assert all(hybrid[r][schedule][0] is None for r in others)
    assert sum(halves) / 2 == pytest.approx(loss.item(), rel=1e-5)
    assert halves[0] != pytest.approx(halves[1])  # the replicas really saw different data
    for replica in (0, 1):
        grads = {**hybrid[_at(0, replica)][schedule][1], **hybrid[_at(1, replica)][schedule][1]}
        assert set(grads) == set(ref)
        for name, g in ref.items():
            torch.testing.assert_close(grads[name], g, rtol=1e-5, atol=1e-6, msg=f"{schedule} replica {replica} {name}")
    # One gradient synchronisation per stage module per mini-batch (DDP records one per sync).
    for r in hybrid:
        assert set(r[schedule][2].values()) == {1}
    # The parameter-free stage (a Tanh alone) is left unwrapped; every other stage has its DDP.
    if schedule == _key("interleaved", [3, 1, 2, 2]):
        assert set(hybrid[_at(1, 0)][schedule][2]) == {3} and set(hybrid[_at(0, 0)][schedule][2]) == {0, 2}


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_gradient_accumulation_reduces_once_at_the_last_step(hybrid, schedule):
    model, (x, y) = _model(), _data(BATCH)
    for part in range(2):  # each step: a quarter of each replica's half, summed over the two steps
        rows = torch.cat([torch.arange(q * BATCH // 4, (q + 1) * BATCH // 4) for q in (part, 2 + part)])
        F.cross_entropy(model(x[rows]), y[rows]).backward()
    ref = _grads(model)
    results = [r["accumulated " + schedule] for r in hybrid]  # (grads, syncs) after each step
    for replica in (0, 1):
        grads = {**results[_at(0, replica)][2], **results[_at(1, replica)][2]}
        assert set(grads) == set(ref)
        for name, g in ref.items():
            torch.testing.assert_close(grads[name], g, rtol=1e-5, atol=1e-6, msg=f"{schedule} replica {replica} {name}")
    # Nothing reduced inside no_sync (the replicas' gradients still differ); one reduction after.
    assert any(not torch.allclose(results[_at(0, 0)][0][n], results[_at(0, 1)][0][n]) for n in results[0][0])
    assert all(set(r[1].values()) == {0} and set(r[3].values()) == {1} for r in results)


def test_hybrid_gpt_cut_by_name_under_zero_bubble(hybrid):
    model, (tokens, mask, target) = _gpt(), _gpt_data()
    loss = lm_loss(model(tokens, attention_mask=mask), target)
    loss.backward()
    halves = [hybrid[_at(0, r)]["gpt"][0] for r in (0, 1)]  # the V's last stage is on pipeline rank 0
    assert sum(halves) / 2 == pytest.approx(loss.item(), rel=1e-5)
    for replica in (0, 1):
        grads = {**hybrid[_at(0, replica)]["gpt"][1], **hybrid[_at(1, replica)]["gpt"][1]}
        assert set(grads) == {n for n, _ in model.named_parameters()}
        for name, p in model.named_parameters():
            torch.testing.assert_close(grads[name], p.grad, rtol=1e-4, atol=1e-6, msg=f"replica {replica} {name}")
    assert all(set(r["gpt"][2].values()) == {1} for r in hybrid)  # each stage reduced once, after its last W
