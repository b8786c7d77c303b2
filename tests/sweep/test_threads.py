"""Threads per rank: equal at every world size by default, a sweep axis, recorded, and an
efficiency above 1 flagged (pure functions; the measured count is checked in test_cli.py)."""

import pandas as pd
import pytest

from commlab.sweep import figdata
from commlab.runs.config import CONFIG_COLUMNS
from commlab.runs.grid import build_grid, merge
from commlab.runs.stats import scaling_efficiency, superlinear, summarise
from commlab.runs.store import RUN_COLUMNS


def plan(**options):
    return build_grid(merge({}, options))


def test_threads_per_rank_do_not_follow_the_world_size():
    p = plan(world_size="1,2,4", overlap="on")
    assert [c.threads for c in p.configs] == [1, 1, 1]
    assert "threads" in CONFIG_COLUMNS and "threads_measured" in RUN_COLUMNS
    assert all("-t1-" in c.id for c in p.configs)


def test_threads_is_a_sweep_axis():
    p = plan(world_size="1,2", threads="1,2", overlap="on")
    assert [(c.world_size, c.threads) for c in p.configs] == [(1, 1), (1, 2), (2, 1), (2, 2)]
    assert len({c.id for c in p.configs}) == 4
    with pytest.raises(ValueError, match="--threads: '0' must be a positive integer"):
        plan(threads="0")


def _runs(rows):
    cfgs = {(c.world_size, c.threads): c for c in plan(world_size="1,2", threads="1,2", overlap="on").configs}
    out = []
    for world, threads, sps in rows:
        out.append({**cfgs[(world, threads)].columns(), "status": "ok", "error": "", "samples_per_s": sps,
                    "step_median": 64 / sps, "step_p10": 0.0, "step_p90": 0.0})
    return pd.DataFrame(out)


def test_scaling_efficiency_compares_equal_threads_and_flags_above_one():
    # world 1 with 2 threads is not the baseline of world 2 with 1 thread: each thread count is
    # its own series, so the confound of the old cpu_count // world_size default cannot appear.
    runs = _runs([(1, 1, 100.0), (2, 1, 150.0), (1, 2, 180.0), (2, 2, 400.0)])
    runs["scaling_efficiency"] = scaling_efficiency(runs)
    assert runs["scaling_efficiency"].tolist() == pytest.approx([1.0, 0.75, 1.0, 400 / 180 / 2])
    warnings = superlinear(runs)
    assert len(warnings) == 1 and "1.11 > 1" in warnings[0] and "2 thread(s) per rank" in warnings[0]
    assert superlinear(runs.iloc[:2]) == []
    # the figure's series names the thread count when it varies
    series = set(figdata.scaling(runs)["series"])
    assert series == {"strong, 1 thread/rank", "strong, 2 threads/rank"}


def test_summarise_keeps_the_configuration_threads_column():
    runs = _runs([(1, 1, 100.0)]).drop(columns=["samples_per_s", "step_median", "step_p10", "step_p90"])
    iterations = pd.DataFrame([{"config": runs.loc[0, "config"], "rank": 0, "iteration": 0, "step": 1.0,
                                **{p: 0.1 for p in ("forward", "backward_compute", "comm", "exposed_comm",
                                                    "optimizer", "total", "accumulate_time")}}])
    out = summarise(runs, iterations)
    assert out.loc[0, "threads"] == 1 and out.loc[0, "samples_per_s"] == pytest.approx(64.0)
