"""The sweep over ZeRO stages: its options, ids, collapsed axes, result columns and figure data
(no processes: bad values are usage errors before any rank starts)."""

import pandas as pd
import pytest
from click.testing import CliRunner

from commlab.cli import main
from commlab.sweep import figdata, runner, wrap as sharding
from commlab.runs import store, traffic
from commlab.runs.config import Config
from commlab.runs.grid import build_grid, merge

BAD = [(["--stage", "4"], "--stage"), (["--stage", "0,x"], "--stage"), (["--prefetch", "-1"], "--prefetch"),
       (["--reshard", "maybe"], "--reshard"), (["--stage", "3", "--algorithm", "tree"], "reduce-scatter"),
       (["--stage", "1", "--bucket-policy", "size_cap_first"], "--bucket-policy")]


@pytest.mark.parametrize("args, message", BAD)
def test_bad_values_are_usage_errors_before_any_process_starts(args, message, tmp_path, monkeypatch):
    monkeypatch.setattr(runner, "measure_config", lambda *a: pytest.fail("a process started"))
    result = CliRunner().invoke(main, ["sweep", *args, "--out", str(tmp_path), "--no-figures"])
    assert result.exit_code == 2 and message in result.output, result.output


def test_the_grid_collapses_prefetch_and_reshard_below_stage_3_and_keeps_old_ids():
    plan = build_grid(merge({}, {"stage": "0,1,2,3", "prefetch": "0,1,2", "reshard": "both", "bucket_mb": "1,25"}))
    by_stage = pd.Series([c.stage for c in plan.configs]).value_counts().to_dict()
    # DDP: 2 buckets x overlap on/off; stages 1-2: 2 buckets (always overlapped); stage 3: x 3 prefetch x 2 reshard
    assert by_stage == {0: 4, 1: 2, 2: 2, 3: 12}
    assert len({c.id for c in plan.configs}) == len(plan.configs)
    assert all((c.prefetch, c.reshard) == (1, True) for c in plan.configs if c.stage < 3)
    # The DDP-only grid's ids are those of results written before stages existed (--resume).
    assert [c.id for c in build_grid(merge({}, {})).configs] == [
        "mlp-gloo-w2-b25-native-ov-a1-g1-t1-f941ca", "mlp-gloo-w2-b25-native-noov-a1-g1-t1-466e64"]
    s3 = next(c for c in plan.configs if c.stage == 3 and not c.reshard and c.prefetch == 2)
    assert "-s3-p2-nors-" in s3.id and Config.from_columns({**s3.columns(), "reshard": "False"}) == s3


def test_comm_bytes_follow_the_standard_accounting():
    b, n = 1000, 4
    assert traffic.comm_bytes([("all_reduce", b)], n) == 2 * 3 / 4 * b
    # stage 3 with reshard: all-gather in forward and again in backward, then a reduce-scatter
    assert traffic.comm_bytes([("all_gather", b), ("all_gather", b), ("reduce_scatter", b)], n) == 3 * 3 / 4 * b


def test_old_records_read_with_stage_defaults_and_new_columns(tmp_path):
    cfg = build_grid(merge({}, {"iters": 1, "overlap": "on"})).configs[0]
    old = {k: v for k, v in cfg.columns().items() if k not in ("stage", "prefetch", "reshard")}
    row = {"rank": 0, "iteration": 0, **{c: 0.1 for c in store.STEP_COLUMNS}}
    store.save_record(tmp_path, {"config": old, "status": "ok", "error": "", "started": 0, "ended": 1,
                                 "iterations": [row], "buckets": []})
    new = build_grid(merge({}, {"iters": 1, "stage": "3", "optimizer": "sgd"})).configs[0]  # as the old record
    measures = {"peak_bytes": 5.0, "comm_bytes": 7.0, "exposed_allgather": 0.25, "exposed_reducescatter": 0.5}
    store.save_record(tmp_path, {"config": new.columns(), "status": "ok", "error": "", "started": 2, "ended": 3,
                                 "iterations": [row], "buckets": [], "measures": measures})
    _, _, runs = store.assemble(tmp_path)
    runs = store.read_tables(tmp_path)[2].set_index("config")
    assert runs.loc[cfg.id, "stage"] == 0 and bool(runs.loc[cfg.id, "reshard"]) and pd.isna(runs.loc[cfg.id, "peak_bytes"])
    assert runs.loc[new.id, ["peak_bytes", "comm_bytes", "exposed_allgather", "exposed_reducescatter"]].tolist() == [5, 7, 0.25, 0.5]
    assert sharding.summary([{"measures": {**measures, "peak_bytes": 9}}, {"measures": measures}])["peak_bytes"] == 9
    fig = figdata.sharded(runs.reset_index())
    # the reductions' bar is the median step's exposed_comm at every stage (0.1 in these rows)
    assert list(fig["series"]) == ["DDP", "stage 3"] and fig["exposed_reduction"].tolist() == [0.1, 0.1]
    assert figdata.sharded(runs.reset_index().iloc[:1]).empty  # one stage: no sharded figure
    from commlab.sweep.figures import draw_all

    assert "sharded.png" in {p.name for p in draw_all(tmp_path, echo=lambda line: None)}
