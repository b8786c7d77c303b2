"""Figures and traces from the fixture sweep in tests/sweep/fixtures/sweep (no processes)."""

import json
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from commlab.sweep import figdata
from commlab.cli.sweep import figures, trace
from commlab.runs.stats import summarise
from commlab.runs.store import read_tables
from commlab.sweep.trace import chrome_trace

FIXTURE = Path(__file__).parent / "fixtures" / "sweep"


def _copy_fixture(to: Path) -> Path:
    for name in ("iterations", "buckets", "runs"):
        shutil.copy(FIXTURE / f"{name}.csv", to / f"{name}.csv")
    return to


@pytest.fixture()
def run_dir(tmp_path):
    return _copy_fixture(tmp_path)


@pytest.fixture(scope="module")
def drawn(tmp_path_factory):
    """The fixture sweep after `commlab figures`: drawn once for the tests of the command and of
    redrawing (laying out a figure's text takes seconds)."""
    run_dir = _copy_fixture(tmp_path_factory.mktemp("drawn"))
    return run_dir, CliRunner().invoke(figures, [str(run_dir)])


def test_figure_tables_follow_the_data(run_dir):
    iterations, buckets, runs = read_tables(run_dir)
    runs = summarise(runs, iterations)  # the fixture's runs.csv predates the quartiles
    bd = figdata.breakdown(runs)
    assert set(bd["panel"]) == {"mlp, gloo, w2, accumulate 1, groups 1"}  # the one panel with both overlaps
    assert len(bd) == 6 and bd["bar"].str.contains("no overlap").sum() == 3
    ov, no = bd[~bd["bar"].str.contains("no overlap")], bd[bd["bar"].str.contains("no overlap")]
    assert (ov["exposed_comm"].to_numpy() < no["exposed_comm"].to_numpy()).all()

    assert bd[figdata.SEGMENTS].sum(axis=1).tolist() == pytest.approx(bd["step"].tolist())

    bucket = figdata.curve(runs, "bucket_mb")
    assert bucket.groupby("series")["bucket_mb"].apply(list).to_dict() == {
        "no overlap, accumulate 1, groups 1": [1.0, 5.0, 25.0], "overlap, accumulate 1, groups 1": [1.0, 5.0, 25.0]}
    assert (bucket["q1"] <= bucket["median"]).all() and (bucket["median"] <= bucket["q3"]).all()
    nosync = figdata.curve(runs, "accumulate")
    raw = runs.set_index("config")
    assert nosync["median"].tolist() == pytest.approx((raw.loc[nosync["config"], "step_median"] / raw.loc[nosync["config"], "accumulate"]).tolist())
    assert figdata.curve(runs, "groups")["groups"].tolist() == [1, 2, 3]

    sc = figdata.scaling(runs)
    assert sc["world_size"].tolist() == [1, 2, 4]
    assert sc["ideal"].tolist() == pytest.approx([sc["samples_per_s"].iloc[0] * w for w in (1, 2, 4)])
    assert sc["scaling_efficiency"].tolist() == pytest.approx((sc["samples_per_s"] / sc["ideal"]).tolist())

    config = figdata.pick_timeline_config(runs, buckets)
    row, bks = figdata.timeline(iterations, buckets, config)
    assert row["config"] == config and bool(row["overlap"]) and len(bks) == buckets.groupby("config")["bucket"].nunique().max()
    single = runs[runs["world_size"] == 4]
    assert figdata.curve(single, "bucket_mb").empty and figdata.scaling(single).empty  # one point: no curve


def test_figures_command_writes_every_supported_figure(drawn):
    run_dir, result = drawn
    assert result.exit_code == 0, result.output
    names = {"breakdown", "bucket_size", "scaling", "no_sync", "round_robin", "timeline"}
    for name in names:
        for suffix in (".png", ".pdf"):
            path = run_dir / "figures" / f"{name}{suffix}"
            assert path.stat().st_size > 1000, path
    assert sorted(result.output.split()) == sorted(str(run_dir / "figures" / f"{n}{s}") for n in names for s in (".png", ".pdf"))
    bad = CliRunner().invoke(figures, [str(run_dir / "figures")])
    assert bad.exit_code == 2 and "not a sweep results directory" in bad.output


def test_trace_is_chrome_trace_json(run_dir):
    iterations, buckets, runs = read_tables(run_dir)
    config = runs[(runs["accumulate"] == 2)]["config"].iloc[0]
    events = chrome_trace(iterations, buckets, config)["traceEvents"]
    spans = [e for e in events if e["ph"] == "X"]
    assert {e["pid"] for e in events} == {0, 1}  # both ranks
    assert all(e["dur"] >= 0 and e["ts"] >= 0 for e in spans)
    n_its = len(iterations[iterations["config"] == config])
    names = [e["name"] for e in spans]
    assert names.count("forward") == n_its and names.count("no_sync micro-batches") == n_its
    assert names.count("all-reduce") == len(buckets[buckets["config"] == config])
    forwards = sorted(e["ts"] for e in spans if e["name"] == "forward" and e["pid"] == 0)
    assert forwards == sorted(set(forwards))  # steps laid end to end, not on top of each other

    result = CliRunner().invoke(trace, [str(run_dir), "--config", config, "-o", str(run_dir / "t.json")])
    assert result.exit_code == 0, result.output
    assert json.loads((run_dir / "t.json").read_text())["otherData"]["config"] == config
    result = CliRunner().invoke(trace, [str(run_dir), "--config", "nope"])
    assert result.exit_code == 2 and "no configuration 'nope'" in result.output


def test_trace_exposed_comm_ends_at_the_last_buckets_completion():
    # timing.py's definition: end of backward compute -> last bucket done; the write-back and
    # the rest of backward's end follow, up to total (here 1 ms after the last bucket).
    import pandas as pd

    it = {"config": "c", "repetition": 0, "rank": 0, "iteration": 0, "accumulate": 1, "accumulate_time": 0.0,
          "forward": 0.010, "backward_compute": 0.020, "comm": 0.015, "exposed_comm": 0.005, "total": 0.036,
          "write_back": 0.001, "unused_allreduce": 0.0, "optimizer": 0.002, "step": 0.038}
    bks = [{"config": "c", "repetition": 0, "rank": 0, "iteration": 0, "bucket": k, "nbytes": 4, "num_params": 1,
            "ready": ready, "launched": ready, "done": done} for k, (ready, done) in enumerate([(0.02, 0.028), (0.03, 0.035)])]
    spans = [e for e in chrome_trace(pd.DataFrame([it]), pd.DataFrame(bks), "c")["traceEvents"] if e["ph"] == "X"]
    (exposed,) = [e for e in spans if e["name"] == "exposed comm"]
    assert exposed["ts"] == pytest.approx(30_000) and exposed["ts"] + exposed["dur"] == pytest.approx(35_000)
    last_done = max(e["ts"] + e["dur"] for e in spans if e["name"] == "all-reduce")
    assert exposed["ts"] + exposed["dur"] == pytest.approx(last_done)


def test_breakdown_parts_add_up_to_the_plotted_step():
    """Per-phase medians of different iterations do not add up to a step; the median step's parts do."""
    import pandas as pd

    from commlab.runs.grid import build_grid, merge
    from commlab.runs.stats import SEGMENTS, summarise

    cfg = build_grid(merge({}, {"overlap": "on"})).configs[0]
    # Forward is long in one iteration, backward in another: each median misses the long one.
    rows = []
    for rank in (0, 1):
        for i, (fwd, bwd) in enumerate([(0.05, 0.01), (0.01, 0.05), (0.01, 0.01)]):
            slow = 0.002 * rank  # rank 1 is the slowest in every iteration
            exposed, opt, acc = 0.004 + slow, 0.003, 0.0
            step = acc + fwd + bwd + exposed + opt + 0.001  # 1 ms between the named phases
            rows.append({"config": cfg.id, "rank": rank, "iteration": i, "forward": fwd, "backward_compute": bwd,
                         "comm": 0.01, "exposed_comm": exposed, "total": fwd + bwd + exposed,
                         "accumulate_time": acc, "optimizer": opt, "step": step})
    iterations = pd.DataFrame(rows)
    runs = summarise(pd.DataFrame([{**cfg.columns(), "status": "ok", "error": ""}]), iterations)
    row = runs.loc[0]
    slowest = iterations[iterations["rank"] == 1]
    assert row["step_median"] == pytest.approx(slowest["step"].median())  # 0.03, 0.07, 0.07: 0.07
    # The parts are one real step's (the middle iteration on its slowest rank), so they add up:
    assert row["forward_median"] == pytest.approx(0.05) and row["backward_compute_median"] == pytest.approx(0.01)
    assert row["other_median"] == pytest.approx(0.001) and row["exposed_comm_median"] == pytest.approx(0.006)
    assert sum(row[f"{s}_median"] for s in SEGMENTS) + row["other_median"] == pytest.approx(row["step_median"])
    assert slowest["forward"].median() + slowest["backward_compute"].median() < 0.04  # phase by phase: short
    bd = figdata.breakdown(runs)
    assert bd[figdata.SEGMENTS].sum(axis=1).iloc[0] == pytest.approx(bd["step"].iloc[0])
    assert bd["step"].iloc[0] == pytest.approx(row["step_median"])
    assert "other" in figdata.SEGMENTS


def test_redrawing_gives_the_same_bytes(drawn):
    from commlab.sweep.figures import draw_all

    run_dir, _ = drawn
    first = {p.name: p.read_bytes() for p in (run_dir / "figures").iterdir()}
    second = {p.name: p.read_bytes() for p in draw_all(run_dir)}
    assert first.keys() == second.keys() and any(n.endswith(".pdf") for n in first)
    assert first == second  # no creation date: committed reference figures change only with their data
    assert b"CreationDate" not in first["breakdown.pdf"]


def test_profiled_traces_merge_on_one_clock():
    from commlab.sweep.torch_trace import SYNC, merge

    def rank_trace(base):
        return {"traceEvents": [{"name": "process_name", "ph": "M", "pid": 999, "args": {"name": "python"}},
                                {"name": SYNC, "ph": "X", "pid": 999, "tid": 1, "ts": base, "dur": 1},
                                {"name": "aten::mm", "ph": "X", "pid": 999, "tid": 1, "ts": base + 50, "dur": 10}]}

    merged = merge([rank_trace(1000.0), rank_trace(7000.0)], "cfg")
    spans = [e for e in merged["traceEvents"] if e["ph"] == "X"]
    assert [(e["pid"], e["name"], e["ts"]) for e in spans] == [
        (0, SYNC, 1000.0), (0, "aten::mm", 1050.0), (1, SYNC, 1000.0), (1, "aten::mm", 1050.0)]
    names = [e["args"]["name"] for e in merged["traceEvents"] if e["name"] == "process_name"]
    assert names == ["rank 0 (torch.profiler)", "rank 1 (torch.profiler)"]
    with pytest.raises(ValueError, match="no 'commlab:clock sync' event"):
        merge([{"traceEvents": []}], "cfg")
