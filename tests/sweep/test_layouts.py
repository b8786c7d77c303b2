"""Sweeps over tensor x pipeline x data layouts: the axes, their checks before any process, the
rank groups, the per-axis columns and the figure by axis; one real 2-rank tp=2 sweep (slow)."""

import math
from types import SimpleNamespace

import pandas as pd
import pytest
from click.testing import CliRunner

import commlab
from commlab.cli import main
from commlab.runs.config import Config
from commlab.runs.grid import build_grid, merge
from commlab.runs.store import AXIS_COLUMNS, ITERATION_COLUMNS
from commlab.sweep import figaxes
from commlab.sweep.layout import axis_seconds, rank_groups


def grid(**options):
    return build_grid(merge({}, {k: str(v) for k, v in options.items()}))


def test_old_ids_are_unchanged_at_tp_and_pp_one():
    # Ids of results made before the layout axes (the defaults' and a stage-1 grid's), written down.
    assert grid(iters=20).configs[0].id == "mlp-gloo-w2-b25-native-ov-a1-g1-t1-f941ca"
    assert [c.id for c in grid(tp=1, pp=1).configs] == [c.id for c in grid().configs]
    row = {k: v for k, v in grid().configs[0].columns().items() if k not in ("tp", "pp")}
    assert Config.from_columns(row) == grid().configs[0]  # a record older than the columns reads back


def test_world_size_is_split_over_the_axes():
    cfgs = grid(model="gpt", tp="1,2", world_size=2, overlap="on").configs
    assert [(c.tp, c.pp, c.dp, c.batch_per_rank) for c in cfgs] == [(1, 1, 2, 32), (2, 1, 1, 64)]
    assert "-tp2-pp1-dp1-" in cfgs[1].id and "-tp" not in cfgs[0].id
    # --dp names the data-parallel size: the world size is the product.
    cfgs = grid(tp=2, dp="1,2", overlap="on").configs
    assert [(c.world_size, c.tp, c.dp, c.global_batch, c.batch_per_rank) for c in cfgs] == [(2, 2, 1, 64, 64), (4, 2, 2, 64, 32)]
    weak = grid(tp=2, dp=2, scaling="weak", batch_per_rank=8, overlap="on").configs[0]
    assert (weak.world_size, weak.global_batch) == (4, 16)


@pytest.mark.parametrize("options, message", [
    ({"tp": 3}, "--world-size 2 is not a multiple of --tp 3 x --pp 1"),
    ({"tp": 2, "dp": 2, "world_size": 2}, "makes world size 4, not --world-size 2"),
    ({"tp": 0}, "--tp: '0' must be a positive integer"),
    ({"tp": 2, "world_size": 4, "global_batch": 63}, "does not split evenly over 2 data-parallel"),
])
def test_bad_layouts_are_value_errors(options, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        grid(**options)


@pytest.mark.parametrize("args, message", [
    (["--tp", "2", "--dp", "2", "--world-size", "2"], "the product of the axes is the world size"),
    (["--model", "gpt", "--model-args", "heads=2,d_model=64", "--tp", "4", "--world-size", "4"],
     "does not divide the attention heads"),
    (["--tp", "2"], "use --model gpt"),
])
def test_bad_layouts_fail_before_any_process(tmp_path, monkeypatch, args, message):
    monkeypatch.setattr(commlab, "launch", lambda *a, **k: pytest.fail("a process was started"))
    result = CliRunner().invoke(main, ["sweep", *args, "--out", str(tmp_path / "out")])
    assert result.exit_code == 2 and message in result.output, result.output
    assert not (tmp_path / "out").exists()


def test_rank_groups_in_torchs_mesh_order():
    # init_device_mesh(("dp", "tp")): tp innermost (consecutive ranks), dp outermost.
    assert rank_groups(4, 2) == ([[0, 1], [2, 3]], [[0, 2], [1, 3]])
    assert rank_groups(2, 2) == ([[0, 1]], [[0], [1]])
    assert rank_groups(2, 1) == ([[0], [1]], [[0, 1]])
    assert rank_groups(8, 4) == ([[0, 1, 2, 3], [4, 5, 6, 7]], [[0, 4], [1, 5], [2, 6], [3, 7]])
    for world, tp in ((8, 2), (6, 3), (4, 4)):
        tps, dps = rank_groups(world, tp)
        for r in range(world):  # rank r: tensor-parallel index r % tp, data-parallel index r // tp
            assert tps[r // tp].index(r) == r % tp and dps[r % tp].index(r) == r // tp
    with pytest.raises(ValueError, match="does not divide"):
        rank_groups(6, 4)


def _iteration(*collectives):
    return SimpleNamespace(collectives=[SimpleNamespace(kind=k, start=s, end=e) for k, s, e in collectives])


def test_axis_seconds_sums_each_kind_over_a_steps_micro_batches():
    warm = _iteration(("all_reduce", 0.0, 9.0))
    its = [warm, _iteration(("all_reduce", 0.0, 0.5), ("all_gather", 1.0, 1.25)),
           _iteration(("all_reduce", 0.0, 0.25), ("reduce_scatter", 2.0, 2.125))]
    (step,) = axis_seconds(its, accumulate=2, steps=1)  # the warm-up forward is not the step's
    assert list(step) == AXIS_COLUMNS
    assert step == {"tp_all_reduce": 0.75, "tp_all_gather": 0.25, "tp_reduce_scatter": 0.125,
                    "pp_send_recv": 0.0, "pp_bubble": 0.0, "dp_reduce": 0.0}
    with pytest.raises(RuntimeError, match="recorded 3 forwards"):
        axis_seconds(its, accumulate=2, steps=2)


def test_iteration_columns_name_each_axis():
    assert AXIS_COLUMNS == ["tp_all_reduce", "tp_all_gather", "tp_reduce_scatter", "pp_send_recv", "pp_bubble",
                            "dp_reduce"]
    assert ITERATION_COLUMNS[-len(AXIS_COLUMNS):] == AXIS_COLUMNS


def _runs():
    rows = []
    for tp, step, ar in ((1, 0.010, 0.0), (2, 0.016, 0.006)):
        cfg = grid(model="gpt", tp=tp, world_size=2, overlap="on").configs[0]
        rows.append({**cfg.columns(), "status": "ok", "step_median": step, "step_q1": step, "step_q3": step,
                     "tp_all_reduce_median": ar, "tp_all_gather_median": 0.0, "tp_reduce_scatter_median": 0.0,
                     "pp_send_recv_median": 0.0, "exposed_comm_median": 0.002 / tp, "optimizer_median": 0.001})
    return pd.DataFrame(rows)


def test_axis_figure_has_one_bar_per_layout_and_one_segment_per_axis():
    df = figaxes.axis_breakdown(_runs())
    assert list(df["bar"]) == ["tp 1 x pp 1 x dp 2", "tp 2 x pp 1 x dp 1"]
    assert figaxes.SEGMENTS == ["tensor", "bubble", "pipeline", "data", "optimizer", "compute"]
    tp2 = df.iloc[1]
    assert math.isclose(tp2["tensor"], 0.006) and math.isclose(tp2["data"], 0.001)
    for _, row in df.iterrows():  # the segments add up to the median step
        assert math.isclose(row[figaxes.SEGMENTS].sum(), row["step"])
    assert figaxes.draw(df) is not None
    ddp_only = _runs().iloc[:1]
    assert figaxes.axis_breakdown(ddp_only).empty  # no layout with tp or pp > 1: no figure


@pytest.mark.slow
def test_two_rank_tensor_parallel_sweep_of_a_tiny_gpt(tmp_path):
    args = ["sweep", "--model", "gpt", "--model-args", "d_model=32,heads=2,layers=2,vocab=64,seq=16", "--tp", "1,2",
            "--world-size", "2", "--iters", "3", "--warmup", "1", "--global-batch", "4", "--overlap", "on",
            "--out", str(tmp_path), "--name", "tp"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    runs = pd.read_csv(tmp_path / "tp" / "runs.csv").set_index("tp")
    its = pd.read_csv(tmp_path / "tp" / "iterations.csv")
    assert set(AXIS_COLUMNS) <= set(its) and (runs["status"] == "ok").all()
    tp1, tp2 = its[its["tp"] == 1], its[its["tp"] == 2]
    assert (tp1[["tp_all_reduce", "tp_all_gather", "tp_reduce_scatter"]] == 0).all().all()
    assert (tp2["tp_all_reduce"] > 0).all() and (its["pp_send_recv"] == 0).all()
    assert (tp1["dp_reduce"] > 0).all()
    assert runs.loc[2, "tp_all_reduce_median"] > 0
    assert (tmp_path / "tp" / "figures" / "axes.png").exists()


def test_predict_refuses_a_tensor_layout_it_would_price_as_ddp(tmp_path):
    spec = tmp_path / "tp.yaml"
    spec.write_text("model: gpt\ntp: 2\n")
    result = CliRunner().invoke(main, ["predict", str(spec), "--out", str(tmp_path / "out")])
    assert result.exit_code == 2 and "--tp > 1: predict and tune price data-parallel grids only" in result.output
