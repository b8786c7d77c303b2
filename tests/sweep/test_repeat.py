"""--repeat: the order of repetitions, their aggregation, resume per repetition, error bars and
the summary that calls no winner inside the spread (a stand-in measurement, no processes)."""

import itertools

import numpy as np
import pandas as pd
import pytest

from commlab.sweep import figdata, runner
from commlab.runs import store
from commlab.runs.grid import build_grid, merge
from commlab.runs.stats import fastest, summarise


def plan(**options):
    return build_grid(merge({}, {"overlap": "both", "iters": 3, **options}))


def test_repetitions_alternate_forward_and_backward():
    p = plan(bucket_mb="1,5", repeat=3)
    ids = [c.id for c in p.configs]
    got = [(r, c.id) for r, c in runner.order(p.configs, p.repeat)]
    assert got == [(0, i) for i in ids] + [(1, i) for i in ids[::-1]] + [(2, i) for i in ids]
    # the overlap pairs a figure compares stay back to back in every repetition
    for r, group in itertools.groupby(runner.order(p.configs, p.repeat), key=lambda x: x[0]):
        seq = [c for _, c in group]
        for a, b in zip(seq[::2], seq[1::2]):
            assert a.bucket_mb == b.bucket_mb and a.overlap != b.overlap
    with pytest.raises(ValueError, match="--repeat"):
        plan(repeat=0)


class Drifting:
    """Each call is slower than the last (the machine drifts); bucket 1 is 10% faster than 5."""

    def __init__(self):
        self.calls = []

    def __call__(self, cfg, p):
        self.calls.append(cfg.id)
        base = (0.100 if cfg.bucket_mb == 1 else 0.110) * (1 + 0.05 * len(self.calls))
        its = [{"rank": 0, "iteration": i, "forward": 0.01, "backward_compute": 0.02, "comm": 0.01,
                "exposed_comm": 0.005, "total": 0.035, "accumulate_time": 0.0, "optimizer": 0.001,
                "step": base + 0.001 * i} for i in range(cfg.iters)]
        return [{"rank": 0, "host": "h", "device": "cpu", "threads": {"torch": 1},
                 "iterations": its, "buckets": []}]


def test_each_configuration_reports_the_median_of_its_repetitions_and_their_spread(tmp_path):
    p = plan(bucket_mb="1,5", overlap="on", repeat=3)
    measure = Drifting()
    lines = []
    runner.run(p, tmp_path, resume=False, echo=lines.append, measure=measure)
    assert len(measure.calls) == 6 and len(list((tmp_path / "configs").glob("*.json"))) == 6
    iterations, _, runs = store.read_tables(tmp_path)
    assert sorted(iterations["repetition"].unique()) == [0, 1, 2] and len(iterations) == 6 * 3
    assert not iterations.duplicated(["config", "repetition", "rank", "iteration"]).any()
    for _, row in runs.iterrows():
        own = iterations[iterations["config"] == row["config"]]
        reps = own.groupby("repetition")["step"].median()
        assert row["repetitions"] == 3
        assert row["step_median"] == pytest.approx(np.median(own["step"]))  # over every repetition's steps
        assert (row["step_spread_lo"], row["step_spread_hi"]) == pytest.approx((reps.min(), reps.max()))
    # Drift of 5% per run against a 10% difference: the spreads overlap, so no winner is called.
    assert [line[:15] for line in fastest(runs)] == ["no clear winner"]
    assert any("repetition 3/3" in line for line in lines)

    # Resume redoes only the missing (configuration, repetition).
    missing = runs["config"].iloc[0]
    (tmp_path / "configs" / f"{missing}.r2.json").unlink()
    again = Drifting()
    runner.run(p, tmp_path, resume=True, echo=lines.append, measure=again)
    assert again.calls == [missing]
    assert len(store.read_tables(tmp_path)[0]) == 6 * 3


def _runs(rows):
    cfgs = plan(bucket_mb="1,5,25", overlap="on").configs
    return pd.DataFrame([{**c.columns(), "status": "ok", "error": "", "repetitions": reps, "step_median": m,
                          "step_spread_lo": lo, "step_spread_hi": hi, "step_p10": lo, "step_p90": hi,
                          "samples_per_s": 64 / m, "scaling_efficiency": np.nan}
                         for c, (reps, m, lo, hi) in zip(cfgs, rows)])


def test_a_winner_only_outside_the_spread():
    clear = _runs([(3, 0.100, 0.098, 0.102), (3, 0.120, 0.118, 0.125), (3, 0.2, 0.19, 0.21)])
    [line] = fastest(clear)
    assert line.startswith("fastest: mlp-gloo-w2-b1-") and "min-max of the repetitions' medians" in line
    close = _runs([(3, 0.100, 0.090, 0.115), (3, 0.105, 0.100, 0.110), (3, 0.2, 0.19, 0.21)])
    assert fastest(close)[0].startswith("no clear winner")
    assert fastest(close.iloc[:1]) == []
    # a different world size does other work per step: it is not a competitor
    other = close.assign(world_size=[2, 4, 2], config=close["config"] + "x")
    assert len(fastest(other)) == 1 and fastest(other)[0].startswith("fastest: mlp-gloo-w2-b1-")
    single = _runs([(1, 0.100, 0.0, 0.0), (1, 0.150, 0.0, 0.0)]).assign(step_q1=[0.09, 0.12], step_q3=[0.11, 0.2])
    assert "q1-q3 of the steps" in fastest(single)[0] and fastest(single)[0].startswith("fastest")
    # with one repetition the interval is the steps' q1-q3, whatever their p10-p90
    overlapping = single.assign(step_q3=[0.13, 0.2])
    assert fastest(overlapping)[0].startswith("no clear winner")


def test_curves_carry_the_spread_and_cells_are_never_shared():
    runs = _runs([(3, 0.100, 0.090, 0.115), (3, 0.105, 0.100, 0.110), (3, 0.2, 0.19, 0.21)])
    curve = figdata.curve(runs, "bucket_mb", 1e3)
    assert curve["spread_lo"].tolist() == pytest.approx([90, 100, 190])
    assert curve["spread_hi"].tolist() == pytest.approx([115, 110, 210])
    # The same bucket sizes measured again with other --iters (a grid resumed with a changed
    # option): two configurations per point, so the setting becomes a series of its own.
    other = runs.assign(iters=30, config=runs["config"] + "-30")
    curve = figdata.curve(pd.concat([runs, other]), "bucket_mb")
    assert sorted(curve["series"].unique()) == ["iters 3", "iters 30"]
    assert not curve.duplicated(["panel", "series", "bucket_mb"]).any()


def test_breakdown_bars_never_share_a_slot():
    runs = _runs([(1, 0.100, 0.1, 0.1), (1, 0.105, 0.1, 0.1), (1, 0.2, 0.2, 0.2)])
    runs = pd.concat([runs, runs.assign(iters=30, config=runs["config"] + "-30")])
    iterations = pd.DataFrame([{"config": c, "rank": 0, "iteration": 0, "step": 0.1, "forward": 0.01,
                                "backward_compute": 0.02, "comm": 0.0, "exposed_comm": 0.03, "total": 0.06,
                                "accumulate_time": 0.0, "optimizer": 0.01} for c in runs["config"]])
    bars = figdata.breakdown(summarise(runs, iterations))["bar"].tolist()
    assert len(bars) == 6 and len(set(bars)) == 6 and "1 MiB\noverlap\niters 30" in bars
