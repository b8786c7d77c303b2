"""Pipeline x data parallel on the cost model: each stage's DDP buckets after its last backward (pure but the CLI)."""

import json

import pytest
from click.testing import CliRunner

from commlab.cli import main
from commlab.costmodel.planner import calibrate as plan_calibrate
from commlab.costmodel.lowering.buckets import bucket_tasks
from commlab.costmodel.terms.costs import CollectiveCost, PointToPoint, StageProfile, SystemCosts
from commlab.costmodel.lowering.pipeline import DataParallel, lower, predict
from commlab.costmodel.planner.plan import LayerProfile, candidates
from commlab.costmodel.calibration.cache import machine_id
from commlab.pipeline import build
from commlab.sim import Task

# An all-reduce of n bytes takes n / 1000 s on 2 ranks; every parameter its own bucket.
TABLE = CollectiveCost((100, 1000), (0.1, 1.0))
SYSTEM = SystemCosts(collectives={("allreduce", "native", 2): TABLE}, p2p=PointToPoint(0.5))
ONE_EACH = DataParallel(2, bucket_cap_mb=1e-6, first_bucket_mb=1e-6)


def test_hybrid_step_is_the_hand_built_task_graph():
    # gpipe, 2 ranks, one micro-batch: 0F0 [0, 1], message [1, 1.5], 1F0 [1.5, 2.5], 1B0 [2.5, 4.5],
    # message [4.5, 5], 0B0 [5, 7]. Stage 0's parameters (300 and 100 bytes, module order) are
    # ready in reverse: buckets of 100 then 300 bytes after 0B0; stage 1's one 200-byte bucket after 1B0.
    stage = StageProfile((1.0, 1.0), (2.0, 2.0), param_nbytes=((300, 100), (200,)), optimizer_s=0.25)
    gp = build("gpipe", 2, 1)
    got = {t.name: t for t in lower(gp, SYSTEM, stage, dp=ONE_EACH) if t.kind in ("allreduce", "optimizer")}
    hand = [
        Task("s0.allreduce0", "dp0", TABLE(100), ("0B0",), "allreduce", meta={"bucket": 0, "nbytes": 100}),
        Task("s0.allreduce1", "dp0", TABLE(300), (), "allreduce", meta={"bucket": 1, "nbytes": 300}),
        Task("optimizer 0", "rank0", 0.25, ("s0.allreduce0", "s0.allreduce1", "0B0"), "optimizer"),
        Task("s1.allreduce0", "dp1", TABLE(200), ("1B0",), "allreduce", meta={"bucket": 0, "nbytes": 200}),
        Task("optimizer 1", "rank1", 0.25, ("s1.allreduce0", "1B0"), "optimizer"),
    ]
    assert got == {t.name: t for t in hand}
    assert [TABLE(n) for n in (100, 200, 300)] == pytest.approx([0.1, 0.2, 0.3])
    # The same buckets the shared DDP piece makes (commlab/costmodel/lowering/buckets.py).
    assert [got[f"s0.allreduce{k}"] for k in range(2)] == bucket_tasks([100, 300], TABLE, after=("0B0",), channel="dp0",
                                                                        prefix="s0.allreduce")  # fmt: skip
    result = predict(gp, SYSTEM, stage, dp=ONE_EACH).result
    assert (result.spans["s0.allreduce1"].start, result.spans["s0.allreduce1"].end) == pytest.approx((7.1, 7.4))
    assert result.spans["s1.allreduce0"].end == pytest.approx(4.7)
    assert result.makespan == pytest.approx(7.4 + 0.25)
    # One data-parallel rank (or none) has nothing to reduce: the optimizer follows the schedule.
    assert predict(gp, SYSTEM, stage, dp=DataParallel(1)).step_time == pytest.approx(7.25)
    # DDP's default cap puts a stage's small parameters in one bucket.
    assert DataParallel(2).buckets([300, 100]) == [400]


def test_more_bucket_bytes_make_the_step_longer():
    actions = build("1f1b", 2, 4)
    steps = []
    for scale in (1, 10, 100, 1000):
        stage = StageProfile((1.0, 1.0), (2.0, 2.0), param_nbytes=((300 * scale, 100 * scale), (200 * scale,)))
        steps.append(predict(actions, SYSTEM, stage, dp=ONE_EACH).step_time)
    assert steps == sorted(steps) and steps[-1] > steps[0] + 100  # 400 kB on rank 0 at 1 ms/kB
    with pytest.raises(ValueError, match="no allreduce cost for algorithm 'native' at world size 4"):
        predict(actions, SYSTEM, StageProfile((1.0, 1.0), (2.0, 2.0), param_nbytes=((4,), (4,))), dp=DataParallel(4))
    with pytest.raises(ValueError, match="each stage's parameter sizes"):
        predict(actions, SYSTEM, StageProfile((1.0, 1.0), (2.0, 2.0)), dp=ONE_EACH)


def test_planner_prices_data_parallel_buckets():
    layer = LayerProfile(seconds=[3.0] * 4, saved=[0.0] * 4, output=[10.0] * 4, params=[400.0] * 4, input_bytes=0.0,
                         forward=[1.0] * 4, param_sizes=[[300, 100]] * 4)  # fmt: skip
    alone = candidates({4: layer}, 2, [1], ["never"], ["1f1b", "zb-h1"], SYSTEM)
    hybrid = candidates({4: layer}, 2, [1], ["never"], ["1f1b", "zb-h1"], SYSTEM, dp=ONE_EACH)
    assert {p.schedule for p in alone} == {"1f1b", "zb-h1"}
    assert [p.schedule for p in hybrid] == ["1f1b"]  # the hybrid runtime refuses split backwards
    (one,) = [p for p in alone if p.schedule == "1f1b"]
    # Rank 1 reduces its 800 bytes (0.8 s) after its last backward; rank 0's last backward ends later.
    exact = predict(build("1f1b", 2, 4), SYSTEM, layer.stage_profile([2, 2], False), dp=ONE_EACH).step_time
    assert hybrid[0].step_time == pytest.approx(exact) and exact > one.step_time
    # DDP's bucket buffers: one more copy of every parameter byte.
    assert max(hybrid[0].peak_bytes) == pytest.approx(max(one.peak_bytes) + 800.0)


def test_plan_dp_takes_the_calibrations_line(tmp_path, monkeypatch):
    path = tmp_path / "calibration.json"
    monkeypatch.setattr(plan_calibrate, "DEFAULT_CALIBRATION", path)
    args = ["pipeline", "plan", "--depth", "2", "--width", "16", "--batch", "8", "-m", "2", "--dp", "2", "--no-calibrate"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code != 0 and "needs a DDP calibration at world size 2" in result.output
    entry = {"key": {"machine": machine_id(), "backend": "gloo", "world_size": 2}, "created": 1.0,
             "collectives": {"native": {"alpha_s": 1e-4, "beta_bytes_per_s": 1e8}}}  # fmt: skip
    path.write_text(json.dumps({"format": 1, "entries": {"mlp-gloo-w2": entry}}))
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    assert "all-reduce from the alpha-beta line of the DDP calibration at world size 2" in result.output
    assert "zb-" not in result.output.split("all-reduce")[1]
    result = CliRunner().invoke(main, ["pipeline", "plan", "--dp", "2", "--validate"])
    assert result.exit_code != 0 and "--validate measures pipeline-only plans" in result.output


def test_predictions_written_before_a_run_meet_the_bench_rows(tmp_path):
    import csv

    from commlab.validation.planner import against_bench, errors, write_predictions

    layer = LayerProfile(seconds=[3.0] * 4, saved=[0.0] * 4, output=[10.0] * 4, params=[0.0] * 4, input_bytes=0.0)
    plans = candidates({2: layer, 4: layer}, 2, [1], ["never", "always"], ["gpipe", "1f1b"], balance_mode="uniform")
    path = tmp_path / "pred.csv"
    assert write_predictions(path, plans) == len(plans) == 8
    predicted = list(csv.DictReader(path.open()))
    one = next(p for p in plans if (p.schedule, p.microbatches, p.checkpoint) == ("1f1b", 4, "always"))
    # A bench summary row (as read back from summary.csv: strings), measured 10% slower than predicted.
    bench = [{"schedule": "1f1b", "microbatches": "4", "virtual": "1", "checkpoint": "always", "balance": "2-2",
              "commlab_s": str(one.step_time * 1.1)},
             {"schedule": "gpipe", "microbatches": "8", "virtual": "1", "checkpoint": "never", "balance": "2-2", "commlab_s": "1.0"}]
    rows = against_bench(predicted, bench)
    assert rows[0]["predicted_s"] == pytest.approx(one.step_time) and rows[0]["error"] == pytest.approx(1 / 1.1 - 1)
    summary = errors(rows)
    assert summary["configurations"] == 1 and summary["unmatched"] == 1  # m=8 was never predicted
    assert summary["median_abs"] == summary["worst_abs"] == pytest.approx(1 - 1 / 1.1)


def test_plan_command_offers_the_optimizers_the_memory_model_knows():
    from commlab.cli.pipeline_options import OPTIMIZERS
    from commlab.costmodel.planner.plan import OPTIMIZER_STATE

    assert OPTIMIZERS == tuple(OPTIMIZER_STATE)


def test_plan_writes_every_prediction_before_any_run(tmp_path):
    import csv

    path = tmp_path / "pred.csv"
    result = CliRunner().invoke(main, ["pipeline", "plan", "--depth", "2", "--width", "16", "--batch", "8", "-m", "2,4",
                                       "--schedules", "gpipe,1f1b", "--checkpoint", "never,always", "--balance", "uniform",
                                       "--no-calibrate", "--top", "1", "--predictions", str(path)])  # fmt: skip
    assert result.exit_code == 0, result.output
    rows = list(csv.DictReader(path.open()))
    assert f"wrote {len(rows)} predictions" in result.output and len(rows) == 2 * 2 * 2  # not only the --top listed
    assert {r["balance"] for r in rows} == {"2-3"} and all(float(r["predicted_s"]) > 0 for r in rows)
