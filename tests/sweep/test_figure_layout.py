"""Figure layout: panels in numeric order with their own y axis, a prediction's note alone, world
size ticks that do not collide, and a bucket queued in the backend drawn apart from a transfer."""

import matplotlib
import pandas as pd
import pytest

from commlab.sweep import figdata, figures
from commlab.runs.grid import build_grid, merge
from commlab.runs.stats import summarise

matplotlib.use("Agg")


def _runs(world_sizes, buckets=(5, 25)):
    plan = build_grid(merge({}, {"world_size": ",".join(map(str, world_sizes)), "bucket_mb": ",".join(map(str, buckets)),
                                 "overlap": "on", "global_batch": 1024}))
    rows = []
    for cfg in plan.configs:
        step = 0.001 * cfg.world_size * (1 + 1 / cfg.bucket_mb)  # w256 is 32 times w8
        rows.append({**cfg.columns(), "status": "ok", "error": "", "step_median": step, "step_p10": step * 0.9,
                     "step_p90": step * 1.1, "step_q1": step * 0.95, "step_q3": step * 1.05, "repetitions": 1, "samples_per_s": 1024 / step,
                     "scaling_efficiency": 1.0})
    return pd.DataFrame(rows)


def test_bucket_size_panels_in_numeric_order_each_with_its_own_y_axis():
    df = figdata.curve(_runs([128, 16, 256, 8]), "bucket_mb", 1e3)
    assert list(dict.fromkeys(df["panel"])) == ["mlp, gloo, w8", "mlp, gloo, w16", "mlp, gloo, w128", "mlp, gloo, w256"]
    fig = figures._curve(df, "bucket_mb", "bucket cap (MiB)", "step latency (ms)", "t", log=True)
    axes = [ax for ax in fig.axes if ax.get_visible()]
    assert [ax.get_title() for ax in axes] == list(dict.fromkeys(df["panel"]))
    for ax, (_, part) in zip(axes, df.groupby("panel", sort=False)):
        assert ax.get_ylim()[1] >= part["q3"].max()  # nothing clipped
    assert axes[0].get_ylim()[1] < axes[-1].get_ylim()[1] / 10  # w8 is not flattened by w256's scale


def test_breakdown_panels_in_numeric_order_and_a_prediction_shows_only_its_note():
    runs = _runs([16, 8])
    plan_ids = runs["config"].tolist()
    its = pd.DataFrame([{"config": c, "rank": 0, "iteration": 0, "forward": 0.001, "backward_compute": 0.002,
                         "comm": 0.001, "exposed_comm": 0.001, "total": 0.004, "accumulate_time": 0.0,
                         "optimizer": 0.001, "step": 0.006} for c in plan_ids])
    runs = pd.concat([runs, runs.assign(overlap=False, config=runs["config"] + "-no")])
    its = pd.concat([its, its.assign(config=its["config"] + "-no")])
    bd = figdata.breakdown(summarise(runs, its))
    assert list(dict.fromkeys(bd["panel"])) == ["mlp, gloo, w8", "mlp, gloo, w16"]
    measured = [t.get_text() for t in figures._breakdown(bd).texts]
    predicted = [t.get_text() for t in figures._breakdown(bd, measured=False).texts]
    assert any(t.startswith("Each bar: the median over the measured iterations") for t in measured)
    assert not any(t.startswith("Each bar") for t in predicted)  # draw_all adds the prediction's note alone


def test_scaling_ticks_are_spaced_on_a_log_axis_with_plain_labels():
    sc = figdata.scaling(_runs([8, 16, 32, 64, 128, 256], buckets=(25,)))
    fig = figures._scaling(sc)
    for ax in fig.axes:
        assert ax.get_xscale() == "log"
        assert [t.get_text() for t in ax.get_xticklabels()] == ["8", "16", "32", "64", "128", "256"]
    small = figures._scaling(figdata.scaling(_runs([1, 2, 4], buckets=(25,))))
    assert small.axes[0].get_xscale() == "linear"


def test_a_bucket_launched_behind_the_groups_previous_all_reduce_is_queued_not_transferring():
    bks = pd.DataFrame({"bucket": [0, 1, 2, 3], "groups": 1, "nbytes": 1,
                        "ready": [1.0, 2.0, 6.0, 9.0], "launched": [1.0, 2.0, 6.0, 9.0], "done": [5.0, 7.0, 8.0, 10.0]})
    out = figdata.transfers(bks)
    # 1 waits for 0 (done at 5); 2 launched at 6 waits for 1 (done at 7); 3 starts at once.
    assert out["started"].tolist() == [1.0, 5.0, 7.0, 9.0]
    two = figdata.transfers(bks.assign(groups=2))  # round robin: 0 and 2 share a group, 1 and 3 another
    assert two["started"].tolist() == [1.0, 2.0, 6.0, 9.0]
    assert figdata.transfers(bks.iloc[0:0]).empty


def test_the_timeline_draws_queued_time_hatched(tmp_path):
    iterations = pd.DataFrame([{"config": "c", "rank": 0, "iteration": 0, "forward": 1.0, "backward_compute": 8.0,
                                "step": 12.0}])
    buckets = pd.DataFrame({"config": "c", "rank": 0, "iteration": 0, "bucket": [0, 1], "groups": 1,
                            "nbytes": 2**20, "ready": [2.0, 3.0], "launched": [2.0, 3.0], "done": [6.0, 9.0]})
    fig = figures._timeline(iterations, buckets, "c")
    hatched = [p for p in fig.axes[0].patches if p.get_hatch()]
    assert len(hatched) == 2 and sorted(p.get_width() for p in hatched) == pytest.approx([0.0, 3000.0])  # ms
