"""The layout planner: layouts of a world, a tensor-parallel step on the core, memory per rank, bad input (pure but the last)."""

import pytest
import torch
from click.testing import CliRunner

from commlab.cli import main
from commlab.costmodel.lowering.pipeline import DataParallel
from commlab.costmodel.planner.layouts import (
    BETWEEN,
    Layout,
    SplitProfile,
    check_layout,
    collective_bytes,
    layouts,
    peak_bytes,
    step_time,
    tp_tasks,
)
from commlab.costmodel.planner.plan import param_copies
from commlab.costmodel.terms.costs import CollectiveCost, SystemCosts
from commlab.sim import simulate
from examples.heldout_models import wide_lm, wide_lm_plan

# An all-reduce of n bytes takes n / 1000 s, at 2 ranks; every parameter its own bucket.
TABLE = CollectiveCost((100, 1000), (0.1, 1.0))
SYSTEM = SystemCosts(collectives={("allreduce", "native", 2): TABLE})
AR = ("all_reduce", 500)
# Three layers: an input layer, one block (one forward, two backward all-reduces), a head.
PROFILE = SplitProfile(forward=(1.0, 2.0, 1.0), backward=(2.0, 4.0, 2.0), forward_collectives=((), (AR,), ()),
                       backward_collectives=((), (AR, AR), ()), param_sizes=((300,), (200, 100), (400,)),
                       saved_bytes=1000.0, temporary_bytes=50.0, tp=2)  # fmt: skip


def test_every_factorisation_of_the_world_and_only_those():
    assert layouts(4) == [Layout(1, 1, 4), Layout(1, 2, 2), Layout(1, 4, 1), Layout(2, 1, 2), Layout(2, 2, 1), Layout(4, 1, 1)]
    assert layouts(2) == [Layout(1, 1, 2), Layout(1, 2, 1), Layout(2, 1, 1)]
    assert all(lay.tp != 4 for lay in layouts(4, heads=6))  # 4 does not divide 6 heads
    assert all(lay.pp <= 2 for lay in layouts(8, max_pp=2))
    assert all(lay.tp * lay.pp * lay.dp == 12 for lay in layouts(12))


@pytest.mark.parametrize("args, message", [((2, 2, 1, 2), "= 4 ranks, not the world size 2"),
                                           ((1, 1, 3, 2), "= 3 ranks, not the world size 2"),
                                           ((4, 1, 1, 4, 6), "does not divide the model's 6 attention heads"),
                                           ((0, 2, 1, 2), "tp must be a positive integer")])  # fmt: skip
def test_bad_layouts_are_value_errors(args, message):
    with pytest.raises(ValueError, match=message):
        check_layout(*args)


def test_tp_step_is_the_hand_built_chain_of_compute_and_collectives():
    tasks = tp_tasks(PROFILE, 2, SYSTEM)
    collectives = [t for t in tasks if t.kind == "tp_all_reduce"]
    assert len(collectives) == 2 * 3  # per micro-batch: one in forward, two in backward
    assert all(t.meta["bytes"] == 500 and t.duration == pytest.approx(0.5) for t in collectives)
    # One chain on the rank: compute 12 s and collectives 1.5 s per micro-batch.
    assert step_time(PROFILE, 2, SYSTEM) == pytest.approx(2 * (12.0 + 1.5))
    assert collective_bytes(PROFILE, 2) == {"all_reduce": 3000, "all_gather": 0, "reduce_scatter": 0}
    # tp 1: the same profile issues no collectives.
    alone = SplitProfile(**{**PROFILE.__dict__, "tp": 1})
    assert not [t for t in tp_tasks(alone, 2, SYSTEM) if t.kind.startswith("tp_")]


def test_a_table_measured_between_compute_prices_the_tensor_parallel_collectives():
    between = SystemCosts(collectives={**SYSTEM.collectives, ("allreduce", BETWEEN, 2): CollectiveCost.line(0.0, 100.0)})
    assert step_time(PROFILE, 1, between) == pytest.approx(12.0 + 3 * 5.0)


def test_ddp_buckets_follow_the_layer_that_holds_their_last_gradient():
    one_each = DataParallel(2, bucket_cap_mb=1e-6, first_bucket_mb=1e-6)
    alone = SplitProfile(**{**PROFILE.__dict__, "tp": 1})
    tasks = {t.name: t for t in tp_tasks(alone, 2, SYSTEM, one_each)}
    buckets = [tasks[f"dp{k}"] for k in range(4)]
    # Ready in reverse module order: 400 (head), 100 and 200 (block), 300 (input layer); last micro-batch only.
    assert [t.meta["bytes"] for t in buckets] == [400, 100, 200, 300]
    assert [t.deps[0] for t in buckets] == ["B1.2", "B1.1", "B1.1", "B1.0"]
    result = simulate(list(tasks.values()))
    assert result.makespan == pytest.approx(2 * 12.0 + 0.3)  # the input layer's bucket after the last backward


def test_ddps_own_work_follows_the_last_bucket_once_per_step():
    one_each = DataParallel(2, bucket_cap_mb=1e-6, first_bucket_mb=1e-6)
    synced = SplitProfile(**{**PROFILE.__dict__, "tp": 1, "sync_s": 0.25})
    tasks = tp_tasks(synced, 2, SYSTEM, one_each)
    assert [t.name for t in tasks if t.kind == "ddp"] == ["ddp_sync"]  # once, not per micro-batch
    assert simulate(tasks).makespan == pytest.approx(2 * 12.0 + 0.3 + 0.25)
    assert not [t for t in tp_tasks(synced, 2, SYSTEM) if t.kind == "ddp"]  # no data parallelism: none


def test_ddp_sync_seconds_is_what_a_one_rank_ddp_adds_to_the_bare_model(tmp_path):
    import torch.distributed as dist

    from commlab.costmodel.planner.split import ddp_sync_seconds

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rdzv'}", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 4))
        x, y = torch.randn(8, 256), torch.zeros(8, dtype=torch.long)
        sync = ddp_sync_seconds(model, x, y, torch.nn.functional.cross_entropy, dist.group.WORLD, repeat=3)
        assert 0.0 <= sync < 1.0
        assert type(model).__name__ == "Sequential" and model[0].weight.grad is not None
    finally:
        dist.destroy_process_group()


def test_memory_per_rank_is_the_share_its_copies_and_one_micro_batch():
    assert peak_bytes(PROFILE) == pytest.approx(2 * 1000 + 1000 + 50)
    assert peak_bytes(PROFILE, dp=2, optimizer="adam") == pytest.approx(param_copies(2, "adam") * 1000 + 1050)


def test_the_split_share_issues_megatrons_collectives_at_half_the_parameters():
    from commlab.costmodel.planner.split import profile_split

    torch.manual_seed(0)
    d, seq, depth = 48, 8, 2
    full = sum(p.numel() * 4 for p in wide_lm(d_model=d, heads=2, depth=depth, seq=seq).parameters())
    x, y = torch.randn(3, seq, 32), torch.zeros(3)
    loss = lambda out, _t: out.pow(2).mean()  # noqa: E731
    plain = profile_split(wide_lm(d_model=d, heads=2, depth=depth, seq=seq), wide_lm_plan(), 2, x, y, loss, repeat=1)
    activation = 3 * seq * d * 4
    assert plain.forward_collectives[0] == plain.forward_collectives[-1] == ()
    for block in range(1, depth + 1):  # row layers' outputs in forward, the column layers' two inputs in backward
        assert plain.forward_collectives[block] == (("all_reduce", activation),) * 2
        assert plain.backward_collectives[block] == (("all_reduce", activation),) * 2
    # q, k, v, the attention's output and the MLP hold half their weights; biases of row layers, norms, ends whole.
    block = wide_lm(d_model=d, heads=2, depth=1, seq=seq).blocks[0]
    split = sum(m.weight.numel() * 2 for m in (block.attn.query, block.attn.key, block.attn.value, block.attn.mix, block.up, block.down))
    split += sum(m.bias.numel() * 2 for m in (block.attn.query, block.attn.key, block.attn.value, block.up))
    assert plain.param_bytes == full - depth * split
    again = profile_split(wide_lm(d_model=d, heads=2, depth=depth, seq=seq), wide_lm_plan(), 2, x, y, loss, recompute=True,
                          repeat=1)  # fmt: skip
    assert again.collective_count() == {"all_reduce": 6 * depth, "all_gather": 0, "reduce_scatter": 0}  # recompute's forward again


def test_a_tp_that_does_not_divide_the_heads_is_refused_before_any_process():
    from commlab.costmodel.planner.split import split_locally

    with pytest.raises(ValueError, match="does not divide the attention heads"):
        split_locally(wide_lm(d_model=48, heads=3), wide_lm_plan(), 2)
    result = CliRunner().invoke(main, ["plan", "--model", "examples.heldout_models:wide_lm", "--model-args", "d_model=48,heads=3"])
    assert result.exit_code == 2 and "--tp-plan" in result.output  # a user model names its plan
    for layout, message in (("2x1x1", "does not divide the model's 3 attention heads"), ("2x2x1", "not the world size 2"),
                            ("2by2", "a layout is TPxPPxDP")):  # fmt: skip
        result = CliRunner().invoke(main, ["plan", "--model", "examples.heldout_models:wide_lm", "--model-args", "d_model=48,heads=3",
                                           "--tp-plan", "examples.heldout_models:wide_lm_plan", "--layout", layout])  # fmt: skip
        assert result.exit_code == 2 and message in result.output, result.output


@pytest.mark.slow
def test_a_tiny_plan_is_priced_measured_and_judged():
    result = CliRunner().invoke(main, ["plan", "--model", "examples.heldout_models:wide_lm", "--model-args",
                                       "d_model=32,heads=2,depth=2,seq=8", "--tp-plan", "examples.heldout_models:wide_lm_plan",
                                       "--batch", "4", "-m", "1,2", "--checkpoint", "never", "--schedules", "gpipe",
                                       "--validate", "--iters", "1", "--warmup", "0", "--budget-mb", "1000"])  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "layouts of 2 ranks: tp1 pp1 dp2, tp1 pp2 dp1, tp2 pp1 dp1" in result.output
    assert "step error: median" in result.output and "x the fastest that fits" in result.output
