"""The console and every figure report one statistic: per iteration the slowest rank's step, the
median over iterations (its phases those of that step), q1-q3 as the band (no processes)."""

import re

import matplotlib
import numpy as np
import pandas as pd
import pytest

from commlab.sweep import figdata, figures, runner
from commlab.runs import store
from commlab.runs.grid import build_grid, merge
from commlab.runs.stats import summarise

matplotlib.use("Agg")


def fake_measure(cfg, _plan):
    """Two ranks, four iterations (an even count: the two middle steps are averaged); rank 1 is
    slower in iterations 0 and 2, rank 0 in 1 and 3, and exposed comm differs by rank."""
    ranks = []
    for rank in (0, 1):
        its = []
        for i in range(4):
            fwd, bwd = 0.010 + 0.001 * i, 0.020 + 0.002 * cfg.bucket_mb / 25
            exposed = 0.004 if (i + rank) % 2 else 0.009  # the slowest rank's is the smaller here
            slow = 0.003 if (i + rank) % 2 else 0.0
            step = fwd + bwd + exposed + 0.001 + 0.0005 + slow
            its.append({"rank": rank, "iteration": i, "forward": fwd, "backward_compute": bwd + slow, "comm": 0.01,
                        "exposed_comm": exposed, "total": fwd + bwd + exposed + slow, "accumulate_time": 0.0,
                        "optimizer": 0.001, "step": step})
        ranks.append({"rank": rank, "host": "h", "device": "cpu", "threads": {"torch": 1}, "iterations": its,
                      "buckets": []})
    return ranks


def numbers(line: str) -> dict[str, float]:
    m = re.search(r"median step ([\d.]+) ms \(q1-q3 ([\d.]+)-([\d.]+)\), of which exposed comm ([\d.]+) ms", line)
    assert m, line
    return dict(zip(("step", "q1", "q3", "exposed"), map(float, m.groups())))


def test_the_console_and_the_figures_tables_agree(tmp_path):
    plan = build_grid(merge({}, {"bucket_mb": "1,25", "overlap": "both", "iters": 4}))
    lines = []
    runner.run(plan, tmp_path, resume=False, echo=lines.append, measure=fake_measure)
    said = {line.split()[0]: numbers(line) for line in lines if "median step" in line}
    assert len(said) == 4
    iterations, _, runs = store.read_tables(tmp_path)
    bd = figdata.breakdown(runs).set_index("config")
    curve = figdata.curve(runs, "bucket_mb", 1e3).set_index("config")
    for config, n in said.items():
        assert bd.loc[config, "step"] * 1e3 == pytest.approx(n["step"], abs=0.051)
        assert bd.loc[config, "exposed_comm"] * 1e3 == pytest.approx(n["exposed"], abs=0.051)
        assert (bd.loc[config, "step_lo"] * 1e3, bd.loc[config, "step_hi"] * 1e3) == pytest.approx((n["q1"], n["q3"]), abs=0.051)
        assert curve.loc[config, "median"] == pytest.approx(n["step"], abs=0.051)
        assert (curve.loc[config, "q1"], curve.loc[config, "q3"]) == pytest.approx((n["q1"], n["q3"]), abs=0.051)
        # ... and that is the statistic named: per iteration the slowest rank, median over iterations
        own = iterations[iterations["config"] == config]
        slowest = own.loc[own.groupby("iteration")["step"].idxmax()]
        assert n["step"] == pytest.approx(np.median(slowest["step"]) * 1e3, abs=0.051)
        middle = slowest.sort_values("step").iloc[1:3]  # four iterations: the two middle ones
        assert n["exposed"] == pytest.approx(middle["exposed_comm"].mean() * 1e3, abs=0.051)
        assert n["exposed"] != pytest.approx(own["exposed_comm"].median() * 1e3, abs=0.051)  # not pooled over ranks


def test_each_figure_names_the_statistic_and_draws_the_band_it_names(tmp_path):
    plan = build_grid(merge({}, {"bucket_mb": "1,25", "overlap": "both", "iters": 4}))
    runner.run(plan, tmp_path, resume=False, echo=lambda _l: None, measure=fake_measure)
    iterations, buckets, runs = store.read_tables(tmp_path)
    bd = figdata.breakdown(runs)
    fig = figures._breakdown(bd)
    ax = fig.axes[0]
    assert "median step" in ax.get_ylabel() and "median step" in fig._suptitle.get_text()
    # the stacked bars reach the console's median step
    tops = {}
    for patch in ax.patches:
        x = round(patch.get_x(), 6)
        tops[x] = max(tops.get(x, 0.0), patch.get_y() + patch.get_height())
    assert sorted(tops.values()) == pytest.approx(sorted(bd["step"] * 1e3))
    assert any("q1-q3" in t.get_text() for t in fig.texts) and ax.collections  # the whiskers the note names

    curve = figures._curve(figdata.curve(runs, "bucket_mb", 1e3), "bucket_mb", "x", "median step (ms)", "Median step",
                           log=True)
    cax = curve.axes[0]
    key = cax.get_legend().get_title().get_text()
    assert "Median step" in curve._suptitle.get_text() and "slowest rank per iteration" in curve._suptitle.get_text()
    assert "band q1-q3" in key
    assert any(type(c).__name__ in ("PolyCollection", "FillBetweenPolyCollection") for c in cax.collections)
    # one iteration: no band drawn, and none named
    flat = runs.assign(step_q1=runs["step_median"], step_q3=runs["step_median"])
    key = figures._curve(figdata.curve(flat, "bucket_mb", 1e3), "bucket_mb", "x", "y", "t").axes[0]
    assert "band" not in key.get_legend().get_title().get_text()


def test_the_timeline_names_a_waiting_bucket_only_when_one_waited():
    its = pd.DataFrame([{"config": "c", "rank": 0, "iteration": 0, "forward": 1.0, "backward_compute": 8.0,
                         "exposed_comm": 1.0, "optimizer": 0.0, "accumulate_time": 0.0, "step": 12.0}])
    launched_at_once = pd.DataFrame({"config": "c", "rank": 0, "iteration": 0, "bucket": [0, 1], "groups": 1,
                                     "nbytes": 2**20, "ready": [2.0, 5.0], "launched": [2.0, 5.0], "done": [4.0, 9.0]})

    def labels(bks):
        return [t.get_text() for t in figures._timeline(its, bks, "c").axes[0].get_legend().get_texts()]

    assert "bucket ready, waiting to launch" not in labels(launched_at_once)
    assert not any("queued" in t for t in labels(launched_at_once))
    # bucket 0 waits 1 ms to launch; bucket 1, launched at 5, then queues behind it until 6
    late = launched_at_once.assign(launched=[3.0, 5.0], done=[6.0, 9.0])
    assert "bucket ready, waiting to launch" in labels(late)
    assert any("queued" in t for t in labels(late))


def test_old_results_redraw_with_todays_statistic(tmp_path):
    """A runs.csv summarised by an older commlab (no quartiles, phases pooled over ranks) is
    summarised again from iterations.csv when figures are drawn."""
    plan = build_grid(merge({}, {"bucket_mb": "1,25", "overlap": "both", "iters": 4}))
    runner.run(plan, tmp_path, resume=False, echo=lambda _l: None, measure=fake_measure)
    iterations, _, runs = store.read_tables(tmp_path)
    old = runs.drop(columns=["step_q1", "step_q3", "other_median"]).assign(exposed_comm_median=1.0)
    again = summarise(old, iterations)
    pd.testing.assert_frame_equal(again[runs.columns], runs, check_dtype=False)


def test_a_sweep_whose_every_configuration_failed_is_summarised_and_drawn_as_nothing(tmp_path):
    from click.testing import CliRunner

    from commlab.cli import main

    def failing(_cfg, _plan):
        raise RuntimeError("rank 0 failed")

    plan = build_grid(merge({}, {"bucket_mb": "1,25", "iters": 4}))
    runner.run(plan, tmp_path, resume=False, echo=lambda _l: None, measure=failing)
    iterations, _, runs = store.read_tables(tmp_path)
    assert iterations.empty and (summarise(runs, iterations)["iterations"] == 0).all()
    result = CliRunner().invoke(main, ["figures", str(tmp_path)])
    assert result.exit_code == 0 and "no successful configuration" in result.output
