"""Sweep specs, the grid, summary statistics and the store: pure functions, no processes."""

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import yaml

from commlab.runs import store
from commlab.sweep.progress import bar, clock
from commlab.runs.config import CONFIG_COLUMNS, Config
from commlab.runs.grid import build_grid, merge
from commlab.runs.options import overlap_values, parse_list, parse_model_args, positive_float
from commlab.runs.stats import scaling_efficiency, summarise


def plan(**options):
    return build_grid(merge({}, options))


def test_parse_lists_and_scalars():
    assert parse_list("5,25,100", positive_float, "bucket_mb") == [5.0, 25.0, 100.0]
    assert parse_list([25, "5", 25], positive_float, "bucket_mb") == [25.0, 5.0]  # order kept, no repeats
    assert parse_list(0.5, positive_float, "bucket_mb") == [0.5]
    for bad, message in (("0", "positive"), ("-3", "positive"), ("abc", "not a number"), ("5,,25", "empty"), ("nan", "positive")):
        with pytest.raises(ValueError, match=message):
            parse_list(bad, positive_float, "bucket_mb")
    assert overlap_values("both") == [True, False]
    assert overlap_values(False) == [False] and overlap_values(["on", "off", "on"]) == [True, False]
    with pytest.raises(ValueError, match="on, off, both"):
        overlap_values("sometimes")
    assert parse_model_args("width=64, depth=2") == {"depth": 2, "width": 64}
    assert parse_model_args({"width": 64}) == {"width": 64}
    with pytest.raises(ValueError, match="key=value"):
        parse_model_args("depth")


def test_merge_precedence_and_unknown_keys():
    merged = merge({"bucket-mb": "1,2", "iters": 7, "scaling": "strong"}, {"bucket_mb": "9", "iters": None})
    assert merged["bucket_mb"] == "9" and merged["iters"] == 7 and merged["world_size"] == "2"
    assert merge({}, {"batch_per_rank": 8})["scaling"] == "weak"  # a per-rank batch alone means weak
    assert merge({"scaling": "strong"}, {"batch_per_rank": 8})["scaling"] == "strong"
    with pytest.raises(ValueError, match="unknown key.*bucket_size"):
        merge({"bucket_size": 5}, {})


def test_grid_is_the_product_with_stable_unique_ids():
    p = plan(bucket_mb="5,25,100", world_size="1,2", overlap="both", accumulate="1,4")
    assert len(p.configs) == 3 * 2 * 2 * 2
    ids = [c.id for c in p.configs]
    assert len(set(ids)) == len(ids)
    assert ids == [c.id for c in plan(bucket_mb="5,25,100", world_size="1,2", overlap="both", accumulate="1,4").configs]
    first = p.configs[0]
    assert first.id.startswith("mlp-gloo-w1-b5-native-ov-a1-g1-")
    assert Config.from_columns(json.loads(json.dumps(first.columns()))) == first  # round-trips via JSON
    assert plan(iters=21).configs[0].id != plan(iters=20).configs[0].id  # any setting changes the id
    assert list(first.columns()) == CONFIG_COLUMNS


def test_the_default_bucket_policy_keeps_the_ids_and_records_made_before_it_was_a_key():
    cfg = plan(iters=3, warmup=1, bucket_mb="1", overlap="on").configs[0]
    assert cfg.bucket_policy == "size_cap"
    # Its id as commlab wrote it before bucket_policy existed (tests/sweep/fixtures/sweep, 2026-11-25).
    assert cfg.id == "mlp-gloo-w2-b1-native-ov-a1-g1-t1-eaaad5"
    old = {k: v for k, v in cfg.columns().items() if k != "bucket_policy"}
    assert Config.from_columns(old) == cfg
    assert plan(iters=3, warmup=1, bucket_mb="1", overlap="on", bucket_policy="size_cap").configs[0].id == cfg.id


def test_strong_and_weak_batches():
    strong = plan(world_size="1,2,4", global_batch=64, overlap="on")
    assert [(c.global_batch, c.batch_per_rank) for c in strong.configs] == [(64, 64), (64, 32), (64, 16)]
    weak = plan(world_size="1,2", scaling="weak", batch_per_rank=8, overlap="on")
    assert [(c.global_batch, c.batch_per_rank) for c in weak.configs] == [(8, 8), (16, 8)]
    with pytest.raises(ValueError, match="does not split evenly"):
        plan(world_size="3", global_batch=64)
    with pytest.raises(ValueError, match="needs --batch-per-rank"):
        plan(scaling="weak")
    with pytest.raises(ValueError, match="--nnodes > 1 needs --launcher torchrun"):
        plan(nnodes=2)


def _iterations(config, world, steps_by_rank):
    rows = []
    for rank, steps in enumerate(steps_by_rank):
        for i, step in enumerate(steps):
            rows.append({"config": config, "rank": rank, "iteration": i, "forward": 0.1, "backward_compute": 0.2,
                         "comm": 0.3, "exposed_comm": 0.05 * (i + 1), "total": 0.4, "accumulate_time": 0.0,
                         "optimizer": 0.01, "step": step})
    return pd.DataFrame(rows)


def _runs(rows):
    base = plan(overlap="on").configs[0].columns()
    return pd.DataFrame([{**base, "status": "ok", "error": "", **r} for r in rows])


def test_summary_uses_the_slowest_rank_and_counts_every_micro_batch():
    steps = [[1.0, 2.0, 3.0, 4.0, 5.0], [1.5, 1.0, 3.0, 4.5, 5.0]]  # per iteration max: 1.5, 2, 3, 4.5, 5
    iterations = _iterations("a", 2, steps)
    runs = _runs([{"config": "a", "world_size": 2, "global_batch": 64, "accumulate": 2}])
    out = summarise(runs, iterations).iloc[0]
    slowest = np.array([1.5, 2.0, 3.0, 4.5, 5.0])
    assert out["step_median"] == pytest.approx(3.0)
    assert out["step_p10"] == pytest.approx(np.quantile(slowest, 0.1))
    assert out["step_p90"] == pytest.approx(np.quantile(slowest, 0.9))
    assert out["exposed_comm_median"] == pytest.approx(0.15)
    assert out["samples_per_s"] == pytest.approx(64 * 2 / 3.0)
    assert out["iterations"] == 5


def test_scaling_efficiency_per_series():
    runs = _runs([
        {"config": "w1", "world_size": 1, "samples_per_s": 100.0},
        {"config": "w2", "world_size": 2, "samples_per_s": 150.0},
        {"config": "w4", "world_size": 4, "samples_per_s": 400.0},
        {"config": "other-w2", "world_size": 2, "bucket_mb": 5.0, "samples_per_s": 90.0},
        {"config": "failed", "world_size": 8, "bucket_mb": 7.0, "status": "failed", "samples_per_s": np.nan},
    ])
    eff = scaling_efficiency(runs)
    assert eff.tolist()[:4] == pytest.approx([1.0, 0.75, 1.0, 1.0])  # other-w2 is its own baseline
    assert np.isnan(eff.iloc[4])


def test_records_are_atomic_and_tables_never_duplicate(tmp_path):
    cfg = plan(overlap="on", iters=2).configs[0]
    rec = {"config": cfg.columns(), "status": "ok", "error": "", "started": 1.0, "ended": 2.0,
           "iterations": _iterations(cfg.id, 1, [[0.5, 0.7]]).drop(columns="config").to_dict("records"),
           "buckets": [{"rank": 0, "iteration": i, "bucket": 0, "nbytes": 4, "num_params": 1,
                        "ready": 0.1, "launched": 0.1, "done": 0.2} for i in range(2)]}
    store.save_record(tmp_path, rec)
    store.save_record(tmp_path, rec)  # a rerun replaces, never appends
    assert sorted(p.name for p in (tmp_path / "configs").iterdir()) == [f"{cfg.id}.json"]  # no temp files left
    iterations, buckets, runs = store.assemble(tmp_path)
    assert len(iterations) == 2 and len(buckets) == 2 and len(runs) == 1
    assert store.finished_ids(tmp_path) == {(cfg.id, 0)}
    read = store.read_tables(tmp_path)
    assert read[2].loc[0, "step_median"] == pytest.approx(0.6) and read[2].loc[0, "error"] == ""


def test_progress_bar_eta():
    assert clock(65) == "1:05" and clock(3725) == "1:02:05"
    assert bar(0, 4, 0.0, width=8) == "[........] 0/4  elapsed 0:00  ETA --:--"
    assert bar(1, 4, 10.0, width=8) == "[##......] 1/4  elapsed 0:10  ETA 0:30"


@pytest.mark.parametrize("spec", sorted((Path(__file__).parents[2] / "sweeps").glob("*.yaml")), ids=lambda p: p.stem)
def test_shipped_specs_are_valid_here(spec):
    from commlab.sweep.runner import check_grid

    p = build_grid(merge(yaml.safe_load(spec.read_text()), {}))
    check_grid(p)  # models, algorithms and backends all available on a CPU-only machine
    assert len(p.configs) >= 2 and len({c.id for c in p.configs}) == len(p.configs)


def test_resuming_compares_grids():
    from commlab.runs.grid import grid_change, grid_signature, grid_union

    old = grid_signature(plan(bucket_mb="1,5", overlap="on"))
    assert grid_change(None, old) is None and grid_change(old, old) is None
    assert grid_change(old, grid_signature(plan(bucket_mb="1", overlap="on"))) is None  # a part of it
    wider = grid_signature(plan(bucket_mb="1,5,25", overlap="on"))
    assert "would add 1 configuration(s)" in grid_change(old, wider)
    assert "would add 2 configuration(s)" in grid_change(old, grid_signature(plan(bucket_mb="1,5", overlap="on", iters=7)))
    assert "--repeat 3 where the run has 1" in grid_change(old, grid_signature(plan(bucket_mb="1,5", overlap="on", repeat=3)))
    both = grid_union(old, wider)
    assert both["configs"] == wider["configs"] and grid_change(both, old) is None


def test_shard_group_axis_makes_hybrid_configurations_and_refuses_what_cannot_be_laid_out():
    p = plan(world_size="4", stage="0,3", shard_group="0,2,4", bucket_mb="25", overlap="on")
    got = {(c.stage, c.shard_group) for c in p.configs}
    # DDP shards nothing (the axis collapses), and a shard group of every dp rank is plain sharding
    assert got == {(0, 0), (3, 0), (3, 2)} and len(p.configs) == 3
    hybrid = next(c for c in p.configs if c.shard_group)
    assert (hybrid.shard, hybrid.replicas) == (2, 2) and "-hs2-" in hybrid.id
    plain = next(c for c in p.configs if c.stage == 3 and not c.shard_group)
    assert (plain.shard, plain.replicas) == (4, 1) and "-hs" not in plain.id
    with pytest.raises(ValueError, match="does not divide the 4 data-parallel"):
        plan(world_size="4", stage="2", shard_group="3")
    with pytest.raises(ValueError, match="needs a --stage of 1-3"):
        plan(world_size="4", stage="0", shard_group="2")
    with pytest.raises(ValueError, match="shard_group|shard-group"):
        plan(world_size="4", stage="2", shard_group="-1")
