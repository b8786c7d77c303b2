"""`pipeline simulate` refuses sizes it cannot simulate in seconds, `pipeline bench` names the
option at fault, and `commlab trace` picks a configuration that communicates (no ranks spawned)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

import commlab
from commlab.cli import main
from commlab.sweep import runner
from commlab.runs import store
from commlab.runs.grid import build_grid, merge


ROOT = str(Path(__file__).resolve().parents[2])


def invoke(*args):
    return CliRunner().invoke(main, list(map(str, args)))


@pytest.fixture
def no_spawn(monkeypatch):
    def refuse(*_a, **_k):
        raise AssertionError("a rank was spawned")

    monkeypatch.setattr(commlab, "launch", refuse)
    monkeypatch.setattr("commlab.runtime.launch.launch", refuse)


@pytest.mark.slow
def test_simulate_refuses_a_size_over_its_limit_before_printing_anything():
    from commlab.cli.pipeline import SIMULATE_LIMIT

    # In a process of its own, so that a regression (minutes of simulation) fails instead of hanging.
    r = subprocess.run([sys.executable, "-m", "commlab.cli", "pipeline", "simulate", "-p", "1000", "-m", "4"],
                       capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": ROOT})
    assert r.returncode == 2 and "4000" in r.stderr and str(SIMULATE_LIMIT) in r.stderr, r.stderr
    assert r.stdout == ""  # not even the table's header
    # zb-v has two stages per rank: p x m = 256 is at its limit, p x m = 512 over it
    assert invoke("pipeline", "simulate", "-p", 8, "-m", 32, "--schedules", "zb-v").exit_code == 0
    r = invoke("pipeline", "simulate", "-p", 8, "-m", 64, "--schedules", "zb-v")
    assert r.exit_code == 2 and "v=2" in r.output and "1024" in r.output


def test_pipeline_bench_names_the_world_size_not_the_depth(no_spawn):
    r = invoke("pipeline", "bench", "--world-size", 64)  # more ranks than this machine's cores can host
    assert r.exit_code == 2 and "--world-size" in r.output and "--depth" not in r.output.split("Error:")[-1][:30]
    assert "64 ranks" in r.output
    r = invoke("pipeline", "bench", "--world-size", 64, "--oversubscribe")  # and more stages than layers
    assert r.exit_code == 2, r.output
    error = r.output.split("Error:")[-1]
    assert "Invalid value for --world-size" in error and "64 pipeline stages" in error and "--depth 8" in error
    r = invoke("pipeline", "bench", "--world-size", 4, "--schedules", "1f1b", "-m", "2,4")  # torch's 1F1B: m >= stages
    assert r.exit_code == 2 and "Schedule1F1B" in r.output and "m=2" in r.output, r.output


def _fake(cfg, _plan):
    its = [{"rank": r, "iteration": 0, "forward": 0.01, "backward_compute": 0.02, "comm": 0.01, "exposed_comm": 0.001,
            "total": 0.031, "accumulate_time": 0.0, "optimizer": 0.001, "step": 0.033} for r in range(cfg.world_size)]
    bks = [{"rank": r, "iteration": 0, "bucket": 0, "nbytes": 4, "num_params": 1, "ready": 0.02, "launched": 0.02,
            "done": 0.03} for r in range(cfg.world_size)]
    return [{"rank": r, "host": "h", "device": "cpu", "threads": {"torch": 1}, "iterations": its if r == 0 else [],
             "buckets": bks if r == 0 else []} for r in range(cfg.world_size)]


def test_trace_picks_a_configuration_that_communicates(tmp_path):
    plan = build_grid(merge({}, {"world_size": "1,2", "overlap": "on", "iters": 1}))
    assert plan.configs[0].world_size == 1  # the first configuration has nothing to all-reduce
    runner.run(plan, tmp_path, resume=False, echo=lambda _l: None, measure=_fake)
    r = invoke("trace", tmp_path)
    assert r.exit_code == 0, r.output
    traced = r.output.strip().splitlines()[-1]
    assert "-w2-" in traced and traced.endswith(".json")
    # Only world size 1 measured: that one, as before.
    solo = tmp_path / "solo"
    runner.run(build_grid(merge({}, {"world_size": "1", "overlap": "on", "iters": 1})), solo, resume=False,
               echo=lambda _l: None, measure=_fake)
    assert "-w1-" in invoke("trace", solo).output
    assert len(store.read_tables(tmp_path)[2]) == 2
