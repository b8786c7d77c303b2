"""The runner's bookkeeping with a stand-in for the measurement: statuses, resume, no-write nodes."""

import pandas as pd
import pytest

from commlab.runtime import LaunchError
from commlab.sweep import runner
from commlab.runs import store
from commlab.runs.grid import build_grid, merge


def fake_results(cfg):
    return [{"rank": r, "host": "h", "device": "cpu",
             "iterations": [{"rank": r, "iteration": i, "forward": 0.1, "backward_compute": 0.2, "comm": 0.1,
                             "exposed_comm": 0.05, "total": 0.35, "accumulate_time": 0.0, "optimizer": 0.01,
                             "step": 0.4 + 0.01 * i} for i in range(cfg.iters)],
             "buckets": []} for r in range(cfg.world_size)]


class Measure:
    """Records which configurations ran; fails the ones listed in ``fail`` in the given way."""

    def __init__(self, fail=None):
        self.ran, self.fail = [], fail or {}

    def __call__(self, cfg, plan):
        self.ran.append(cfg.id)
        if cfg.bucket_mb in self.fail:
            raise self.fail[cfg.bucket_mb]
        return fake_results(cfg)


def test_statuses_resume_and_retry(tmp_path):
    plan = build_grid(merge({}, {"bucket_mb": "1,2,3", "overlap": "on", "iters": 3}))
    lines = []
    first = Measure({2.0: LaunchError("ranks [1] did not finish within 5 s"),
                     3.0: LaunchError("rank 1 failed", 1, "Traceback ...\nValueError: boom")})
    runner.run(plan, tmp_path, resume=False, echo=lines.append, measure=first)
    runs = pd.read_csv(tmp_path / "runs.csv").set_index("bucket_mb")
    assert runs["status"].to_dict() == {1.0: "ok", 2.0: "timeout", 3.0: "failed"}
    assert "ValueError: boom" in runs.loc[3.0, "error"]
    assert runs.loc[1.0, "step_median"] == pytest.approx(0.41) and runs.loc[1.0, "samples_per_s"] == pytest.approx(64 / 0.41)
    assert sum("TIMEOUT" in line or "FAILED" in line for line in lines) == 2

    second = Measure()
    runner.run(plan, tmp_path, resume=True, echo=lines.append, measure=second)
    assert second.ran == [c.id for c in plan.configs[1:]]  # ok skipped, failures retried
    runs = pd.read_csv(tmp_path / "runs.csv")
    assert (runs["status"] == "ok").all() and runs["config"].is_unique and len(runs) == 3
    iterations = pd.read_csv(tmp_path / "iterations.csv")
    assert len(iterations) == 3 * 2 * 3 and not iterations.duplicated(["config", "rank", "iteration"]).any()

    third = Measure()
    runner.run(plan, tmp_path, resume=True, echo=lines.append, measure=third)
    assert third.ran == [] and len(pd.read_csv(tmp_path / "runs.csv")) == 3


def test_a_node_that_does_not_write(tmp_path):
    plan = build_grid(merge({}, {"bucket_mb": "1", "overlap": "on", "iters": 2}))
    measure = Measure()
    records = runner.run(plan, tmp_path, resume=False, echo=lambda _: None, write=False, measure=measure)
    assert len(measure.ran) == 1 and records[0]["status"] == "ok"
    assert list(tmp_path.iterdir()) == []
    assert store.finished_ids(tmp_path) == set()


def test_a_sweep_where_everything_failed_still_has_its_tables(tmp_path):
    plan = build_grid(merge({}, {"bucket_mb": "1,2", "overlap": "on"}))
    boom = RuntimeError("torchrun exited with code 1")
    runner.run(plan, tmp_path, resume=False, echo=lambda _: None, measure=Measure({1.0: boom, 2.0: boom}))
    iterations, buckets, runs = store.read_tables(tmp_path)
    assert iterations.empty and buckets.empty
    assert (runs["status"] == "failed").all() and runs["step_median"].isna().all() and (runs["iterations"] == 0).all()


def test_run_directory_choice(tmp_path):
    import os

    import click

    from commlab.cli.sweep import _run_dir

    for name, mtime in (("older", 1_000), ("newer", 2_000)):
        (tmp_path / name / "configs").mkdir(parents=True)
        (tmp_path / name / "configs" / "x.json").write_text("{}")
        os.utime(tmp_path / name / "configs", (mtime, mtime))
    assert _run_dir(str(tmp_path), None, resume=True) == tmp_path / "newer"  # --resume: the latest run
    assert _run_dir(str(tmp_path), "older", resume=True) == tmp_path / "older"
    with pytest.raises(click.UsageError, match="already holds results"):
        _run_dir(str(tmp_path), "older", resume=False)
    assert _run_dir(str(tmp_path), "older", resume=False, writer=False) == tmp_path / "older"
    assert _run_dir(str(tmp_path), None, resume=False).name.startswith("sweep-")
    with pytest.raises(click.UsageError, match="no sweep to resume"):
        _run_dir(str(tmp_path / "empty"), None, resume=True)
    # --resume with a name that has no run: refused, naming the runs there (none started fresh)
    with pytest.raises(click.UsageError, match=r"no sweep named 'typo' under .* \(runs there: newer, older\)"):
        _run_dir(str(tmp_path), "typo", resume=True)
    assert not (tmp_path / "typo").exists()
    (tmp_path / "stopped").mkdir()
    (tmp_path / "stopped" / "metadata.json").write_text("{}")  # stopped before a configuration finished
    assert _run_dir(str(tmp_path), "stopped", resume=True) == tmp_path / "stopped"
