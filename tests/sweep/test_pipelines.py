"""Sweeps with pipeline stages (--pp > 1): the grid's micro-batch and schedule axes, the refusals
before any process, the model's pieces and their balance, the figure's pipeline share; one real
2-rank sweep of pp = 2 beside pp = 1 (slow)."""

import itertools
import math
from types import SimpleNamespace

import pandas as pd
import pytest
import torch
from click.testing import CliRunner

import commlab
from commlab.cli import main
from commlab.models import build_workload
from commlab.runs.grid import build_grid, merge
from commlab.sweep import figaxes, runner
from commlab.pipeline.schedule.actions import FORWARD
from commlab.pipeline.schedule.registry import build
from commlab.sweep.pipelined import pieces, replayed_idle, stage_balance

TINY_GPT = "d_model=32,heads=2,layers=2,vocab=64,seq=16"


def grid(**options):
    return build_grid(merge({}, {k: str(v) for k, v in options.items()}))


def test_micro_batches_default_to_twice_the_stages_and_collapse_without_a_pipeline():
    cfgs = grid(pp="1,2,4", dp=1, overlap="on").configs
    assert [(c.world_size, c.pp, c.microbatches, c.schedule) for c in cfgs] == [(1, 1, 1, "1f1b"), (2, 2, 4, "1f1b"),
                                                                                 (4, 4, 8, "1f1b")]
    assert "-tp1-pp2-dp1-m4-1f1b-" in cfgs[1].id and "-m1" not in cfgs[0].id
    # Named micro-batch counts and schedules are axes of the pipelined layouts only.
    cfgs = grid(pp="1,2", dp=1, microbatches="2,8", schedule="gpipe,1f1b", overlap="on").configs
    assert [(c.pp, c.microbatches, c.schedule) for c in cfgs] == [(1, 1, "1f1b"), (2, 2, "gpipe"), (2, 2, "1f1b"),
                                                                  (2, 8, "gpipe"), (2, 8, "1f1b")]
    assert len({c.id for c in cfgs}) == len(cfgs)
    # A data-parallel grid keeps the ids it had before the pipeline axes.
    assert grid(iters=20).configs[0].id == "mlp-gloo-w2-b25-native-ov-a1-g1-t1-f941ca"


@pytest.mark.parametrize("options, message", [
    ({"tp": 1, "pp": 2, "dp": 2, "world_size": 2}, "makes world size 4, not --world-size 2"),
    ({"pp": 2, "world_size": 3}, "--world-size 3 is not a multiple of --tp 1 x --pp 2"),
    ({"pp": 2, "dp": 1, "global_batch": 6}, "--microbatches 4 (the default, 2 x --pp) does not divide the batch of 6"),
    ({"pp": 2, "dp": 2, "microbatches": 3}, "--microbatches 3 does not divide the batch of 32"),
    ({"pp": 2, "dp": 1, "stage": 1}, "--pp 2 --stage 1"),
    ({"pp": 2, "dp": 1, "microbatches": 0}, "--microbatches: '0' must be a positive integer"),
])
def test_bad_pipeline_layouts_are_value_errors(options, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        grid(**options)


@pytest.mark.parametrize("args, message", [
    (["--model-args", "depth=2,width=8", "--pp", "4", "--dp", "1"], "has 3 pieces to cut between, so at most 3 stages"),
    (["--model", "transformer", "--pp", "2", "--dp", "1"], "use --model mlp or gpt"),
    (["--pp", "2", "--dp", "1", "--schedule", "zb-h1"], "a sweep runs gpipe, 1f1b"),
    (["--pp", "2", "--dp", "1", "--schedule", "nope"], "--schedule nope: unknown"),
    (["--pp", "2", "--dp", "1", "--stage", "3"], "ZeRO under a pipeline"),
    (["--pp", "2", "--dp", "2", "--world-size", "2"], "the product of the axes is the world size"),
])
def test_bad_pipelines_fail_before_any_process(tmp_path, monkeypatch, args, message):
    monkeypatch.setattr(commlab, "launch", lambda *a, **k: pytest.fail("a process was started"))
    monkeypatch.setattr(runner, "measure_config", lambda *a: pytest.fail("a process was started"))
    result = CliRunner().invoke(main, ["sweep", *args, "--out", str(tmp_path / "out")])
    assert result.exit_code == 2 and message in result.output, result.output
    assert not (tmp_path / "out").exists()


def test_the_gpts_pieces_compute_the_gpt():
    torch.manual_seed(0)
    workload = build_workload("gpt", **{k: int(v) for k, v in (kv.split("=") for kv in TINY_GPT.split(","))})
    tokens, _ = workload.make_batch(3, torch.Generator().manual_seed(1))
    seq = pieces("gpt", workload.model)
    assert len(seq) == 2 + len(workload.model.layers)
    torch.testing.assert_close(seq(tokens), workload.model(tokens), rtol=0, atol=0)
    # The pieces share the GPT's parameters (the pipeline trains the model itself).
    assert {id(p) for p in seq.parameters()} == {id(p) for p in workload.model.parameters()}
    # The MLP's ReLUs stay with their Linear layers: every piece has parameters to train.
    mlp = build_workload("mlp", depth=2, width=8).model
    seq = pieces("mlp", mlp)
    assert [len(list(piece.children())) for piece in seq] == [2, 2, 0] and seq[2] is mlp[4]
    x = torch.randn(3, 8)
    torch.testing.assert_close(seq(x), mlp(x), rtol=0, atol=0)
    with pytest.raises(ValueError, match="mlp or gpt only"):
        pieces("transformer", build_workload("transformer", layers=1, d_model=16, heads=2, seq=4, vocab=16).model)


@pytest.mark.parametrize("model, sizes, pp", [("mlp", {"depth": 3, "width": 8}, 2), ("mlp", {"depth": 3, "width": 8}, 3),
                                              ("gpt", {"layers": 3, "d_model": 16, "heads": 2}, 2)])
def test_stages_balance_parameters_as_well_as_any_cut(model, sizes, pp):
    seq = pieces(model, build_workload(model, **sizes).model)
    weight = [1 + sum(p.numel() for p in piece.parameters()) for piece in seq]
    balance = stage_balance(seq, pp)
    assert len(balance) == pp and sum(balance) == len(seq) and min(balance) >= 1

    def largest(counts):
        bounds = list(itertools.accumulate(counts, initial=0))
        return max(sum(weight[a:b]) for a, b in zip(bounds, bounds[1:]))

    every_cut = [[b - a for a, b in zip((0, *cuts), (*cuts, len(seq)))]
                 for cuts in itertools.combinations(range(1, len(seq)), pp - 1)]
    assert largest(balance) == min(largest(c) for c in every_cut)


def test_the_bubble_is_the_replayed_idle_time_of_every_pipeline_step(monkeypatch):
    # Uniform stages (forward 1, backward 2) under 1F1B, p = 2, m = 4: the closed form's bubble
    # (p - 1) / (m + p - 1) of a (m + p - 1) x 3 step is 3 s idle on each rank, per pipeline step.
    ranks, m = 2, 4
    per_rank = [[[{a: 1.0 if a.kind == FORWARD else 2.0 for a in actions} for _ in range(accumulate)]
                 for accumulate in (1, 2)] for actions in build("1f1b", ranks, m, 1)]
    monkeypatch.setattr(torch.distributed, "all_gather_object", lambda out, obj, group=None: out.__setitem__(
        slice(None), per_rank))
    expected = (ranks - 1) / (m + ranks - 1) * (m + ranks - 1) * 3.0
    for rank in range(ranks):
        trainer = SimpleNamespace(cfg=SimpleNamespace(schedule="1f1b", pp=ranks, microbatches=m), compute=per_rank[rank],
                                  stages=SimpleNamespace(ranks=ranks, group=None, rank=rank))
        assert replayed_idle(trainer) == pytest.approx([expected, 2 * expected])
    per_rank[1][0][0].popitem()  # an action without its time: refused, not priced as nothing
    with pytest.raises(RuntimeError, match="timed 15 actions of the schedule's 16"):
        replayed_idle(trainer)


def test_axis_figure_splits_the_pipelines_waits_into_bubble_and_messages():
    rows = []
    for pp, send_recv, bubble in ((1, 0.0, 0.0), (2, 0.004, 0.003), (2, 0.001, 0.002)):
        cfg = grid(pp=pp, dp=1, overlap="on", microbatches=2 if send_recv == 0.001 else 4).configs[0]
        rows.append({**cfg.columns(), "status": "ok", "step_median": 0.02, "step_q1": 0.02, "step_q3": 0.02,
                     "tp_all_reduce_median": 0.0, "tp_all_gather_median": 0.0, "tp_reduce_scatter_median": 0.0,
                     "pp_send_recv_median": send_recv, "pp_bubble_median": bubble, "exposed_comm_median": 0.001,
                     "optimizer_median": 0.001})
    df = figaxes.axis_breakdown(pd.DataFrame(rows))
    assert list(df["bar"]) == ["tp 1 x pp 1 x dp 1", "tp 1 x pp 2 x dp 1\nm 4, 1f1b", "tp 1 x pp 2 x dp 1\nm 2, 1f1b"]
    assert df[["bubble", "pipeline"]].values.ravel().tolist() == pytest.approx([0.0, 0.0, 0.003, 0.001, 0.001, 0.0])
    for _, row in df.iterrows():  # the bubble is a part of the waits, never more: the segments still add up
        assert math.isclose(row[figaxes.SEGMENTS].sum(), row["step"])
    assert figaxes.draw(df) is not None


@pytest.mark.slow
def test_two_rank_sweep_of_a_two_stage_pipeline_beside_data_parallelism(tmp_path):
    args = ["sweep", "--model", "gpt", "--model-args", TINY_GPT, "--tp", "1", "--pp", "1,2", "--world-size", "2",
            "--iters", "3", "--warmup", "1", "--global-batch", "4", "--overlap", "on", "--out", str(tmp_path),
            "--name", "pp"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    runs = pd.read_csv(tmp_path / "pp" / "runs.csv").set_index("pp")
    its = pd.read_csv(tmp_path / "pp" / "iterations.csv")
    assert (runs["status"] == "ok").all() and sorted(runs.index) == [1, 2]
    assert runs.loc[2, "microbatches"] == 4 and runs.loc[1, "microbatches"] == 1
    assert (its.groupby("pp")["rank"].unique().map(sorted) == pd.Series({1: [0, 1], 2: [0, 1]})).all()
    pp1, pp2 = its[its["pp"] == 1], its[its["pp"] == 2]
    assert (its[["step", "forward", "backward_compute"]] > 0).all().all()
    assert (pp2["pp_send_recv"] > 0).all() and (pp2["pp_bubble"] > 0).all()
    assert (pp1[["pp_send_recv", "pp_bubble"]] == 0).all().all()
    assert (pp1["dp_reduce"] > 0).all()  # two replicas reduce; the pipeline's stages have one each
    assert (runs["peak_bytes"] > 0).all() and runs.loc[2, "pp_send_recv_median"] > 0
    assert (tmp_path / "pp" / "figures" / "axes.png").exists()
