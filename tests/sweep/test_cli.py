"""`commlab sweep` end to end: help, bad input, a tiny real sweep with a failing configuration,
and --resume after the sweep process was killed (few spawns, many checks per spawn)."""

import json
import os
import signal
import subprocess
import sys
import time
from importlib.util import find_spec
from pathlib import Path

import pandas as pd
import pytest
import torch
from click.testing import CliRunner

from commlab.cli import main
from commlab.runs.config import CONFIG_COLUMNS
from commlab.runs.store import BUCKET_COLUMNS, ITERATION_COLUMNS

FIXTURES = Path(__file__).parent / "fixtures"
TINY = ["--model-args", "depth=2,width=64", "--overlap", "on", "--world-size", "1", "--iters", "2",
        "--warmup", "1", "--global-batch", "8"]
MLP_BYTES = 4 * ((64 * 64 + 64) * 2 + 64 * 10 + 10)  # depth 2, width 64, 10 classes, float32


def sweep(*args):
    return CliRunner().invoke(main, ["sweep", *map(str, args)])


def test_help_lists_the_options():
    result = sweep("--help")
    assert result.exit_code == 0
    for option in ("--bucket-mb", "--backend", "--world-size", "--algorithm", "--overlap", "--accumulate",
                   "--groups", "--scaling", "--global-batch", "--batch-per-rank", "--resume", "--launcher", "--timeout"):
        assert option in result.output
    for command in ("figures", "trace"):
        assert CliRunner().invoke(main, [command, "--help"]).exit_code == 0


def test_trace_takes_its_old_spelling_profile_with_a_warning(tmp_path):
    text = CliRunner().invoke(main, ["trace", "--help"]).output
    assert "--torch-profiler" in text and "--profile" not in text
    # parsed (and warned about) before the missing results are found: no process started
    old = CliRunner().invoke(main, ["trace", str(tmp_path), "--profile"])
    assert old.exit_code == 2 and "--profile is deprecated and goes in a later release: use --torch-profiler" in old.output
    both = CliRunner().invoke(main, ["trace", str(tmp_path), "--profile", "--torch-profiler"])
    assert both.exit_code == 2 and "give --torch-profiler only" in both.output


@pytest.mark.parametrize("args, message", [
    (["--bucket-mb", "0"], "must be a positive number"),
    (["--bucket-mb", "-3"], "must be a positive number"),
    (["--bucket-mb", "abc"], "'abc' is not a number"),
    (["--bucket-mb", "5,,25"], "empty item"),
    (["--model", "nope"], "unknown model 'nope'"),
    (["--model", "no_such_module_xyz:factory"], "cannot import"),
    (["--model-args", "depth=2,colour=3"], "takes sizes"),
    (["--model", "transformer", "--model-args", "d_model=30,heads=4"], "--model transformer --model-args d_model=30,heads=4"),
    (["--backend", "mpi"], "unknown backend 'mpi'"),
    (["--algorithm", "carrier_pigeon"], "unknown all-reduce algorithm 'carrier_pigeon'"),
    (["--world-size", "0"], "must be a positive integer"),
    (["--world-size", "2", "--global-batch", "63"], "does not split evenly"),
    (["--overlap", "maybe"], "Invalid value for '--overlap'"),
    (["--timeout", "0"], "--timeout"),
    (["--scaling", "weak"], "needs --batch-per-rank"),
    (["--name", "../escape"], "must be a plain directory name inside --out"),
    (["--name", "/tmp/abs"], "must be a plain directory name inside --out"),
    (["--name", "a/b"], "must be a plain directory name inside --out"),
    (["--name", ""], "an empty name"),
    (["--name", "  "], "an empty name"),
    (["--world-size", "64"], "64 ranks x 1 thread(s)"),
    (["--world-size", "2", "--threads", "64"], "more than 2 per core"),
    (["--repeat", "0"], "--repeat"),
])
def test_bad_input_is_a_click_error_before_any_process(tmp_path, args, message):
    result = sweep(*args, "--out", tmp_path / "out")
    assert result.exit_code == 2, result.output
    assert message in result.output
    assert not (tmp_path / "out").exists()  # nothing started, nothing written


def test_environment_dependent_input(tmp_path):
    if not torch.cuda.is_available():
        result = sweep("--backend", "nccl", "--world-size", "2", "--out", tmp_path)
        assert result.exit_code == 2 and "CUDA device" in result.output
    if find_spec("torchvision") is None:
        result = sweep("--model", "resnet50", "--out", tmp_path)
        assert result.exit_code == 2 and "commlab[models]" in result.output
    spec = tmp_path / "bad.yaml"
    spec.write_text("bucket_size: 5\n")
    result = sweep(spec, "--out", tmp_path)
    assert result.exit_code == 2 and "unknown key(s) in the spec file: bucket_size" in result.output
    assert list(tmp_path.iterdir()) == [spec]


@pytest.mark.slow
def test_tiny_sweep_results_and_a_failing_configuration(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(FIXTURES))  # spawned ranks inherit sys.path
    result = sweep("--model", "mlp,sweep_models:fails_on_rank1", "--bucket-mb", "0.01", *TINY,
                   "--world-size", "2", "--out", tmp_path, "--name", "tiny", "--timeout", 120)
    run_dir = tmp_path / "tiny"
    assert result.exit_code == 1, result.output  # failures are reported, after everything is written
    assert "1 configuration(s) failed" in result.output and "ETA" in result.output

    runs = pd.read_csv(run_dir / "runs.csv")
    assert len(runs) == 2 and runs["config"].is_unique
    good, bad = runs[runs["model"] == "mlp"], runs[runs["model"] != "mlp"]
    assert (good["status"] == "ok").all() and (bad["status"] == "failed").all()
    assert bad["error"].str.contains("boom: this factory fails on rank 1").all()
    assert (bad["iterations"] == 0).all() and bad["step_median"].isna().all()
    assert (good["iterations"] == 2).all()
    assert good["samples_per_s"].tolist() == pytest.approx((8 / good["step_median"]).tolist())
    assert (good["step_p10"] <= good["step_median"]).all() and (good["step_median"] <= good["step_p90"]).all()

    iterations = pd.read_csv(run_dir / "iterations.csv")
    assert list(iterations.columns) == CONFIG_COLUMNS + ITERATION_COLUMNS
    assert len(iterations) == 1 * 2 * 2  # ok configurations x ranks x iterations
    assert not iterations.duplicated(["config", "rank", "iteration"]).any()
    assert set(iterations["config"]) == set(good["config"])
    times = iterations[ITERATION_COLUMNS[2:]]
    assert (times >= 0).all().all()
    assert (iterations["step"] >= iterations["total"] + iterations["optimizer"] - 1e-6).all()
    assert (iterations["forward"] + iterations["backward_compute"] <= iterations["total"] + 1e-6).all()

    buckets = pd.read_csv(run_dir / "buckets.csv")
    assert list(buckets.columns) == CONFIG_COLUMNS + BUCKET_COLUMNS
    per_iteration = buckets.groupby(["config", "rank", "iteration"])
    assert (per_iteration["nbytes"].sum() == MLP_BYTES).all()  # every gradient byte in one bucket
    assert (per_iteration["bucket"].nunique() > 1).all()  # a 0.01 MiB cap splits the gradients
    assert ((buckets["ready"] <= buckets["launched"]) & (buckets["launched"] <= buckets["done"])).all()

    meta = json.loads((run_dir / "metadata.json").read_text())
    assert meta["environment"]["torch"] == torch.__version__
    assert meta["sessions"][0]["end"] and "sweep" in meta["sessions"][0]["command"]
    assert meta["hosts"] and meta["devices"] == ["cpu"]
    assert len(list((run_dir / "configs").glob("*.json"))) == 2
    for name in ("breakdown", "timeline"):
        assert (run_dir / "figures" / f"{name}.png").stat().st_size > 1000

    again = sweep("--model", "mlp", "--bucket-mb", "0.01", *TINY, "--out", tmp_path, "--name", "tiny")
    assert again.exit_code == 2 and "already holds results" in again.output
    traced = CliRunner().invoke(main, ["trace", str(run_dir), "--config", good["config"].iloc[0]])
    assert traced.exit_code == 0, traced.output
    assert json.loads(Path(traced.output.strip()).read_text())["traceEvents"]

    # The real trace: the same configuration rerun under torch.profiler, ranks merged on one clock.
    profiled = CliRunner().invoke(main, ["trace", str(run_dir), "--config", good["config"].iloc[0], "--torch-profiler",
                                         "--steps", "2"])
    assert profiled.exit_code == 0, profiled.output
    trace = json.loads(Path(profiled.output.strip().splitlines()[-1]).read_text())
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    by_rank = {r: {e["name"] for e in events if e["pid"] == r} for r in (0, 1)}
    for names in by_rank.values():
        assert {"commlab:forward", "commlab:backward + gradient all-reduce", "commlab:optimizer"} <= names
        assert any("all_reduce" in n for n in names)  # the backend's own collective events
    syncs = [e["ts"] for e in events if e["name"] == "commlab:clock sync"]
    assert len(syncs) == 2 and syncs[0] == pytest.approx(syncs[1])


def _session_gone(sid, wait=15.0):
    """True once no process is left in session ``sid`` (multiprocessing's resource tracker takes
    a moment to see its parent go)."""
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline:
        try:
            os.killpg(sid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.2)
    return False


def test_resume_with_a_changed_grid_is_refused(tmp_path):
    from commlab.runs.grid import build_grid, grid_signature, merge

    run_dir = tmp_path / "run"
    (run_dir / "configs").mkdir(parents=True)
    (run_dir / "configs" / "x.json").write_text("{}")
    recorded = build_grid(merge({}, {"bucket_mb": "0.01,1", "iters": 2}))
    (run_dir / "metadata.json").write_text(json.dumps({"grid": grid_signature(recorded)}))
    for extra, message in ((["--bucket-mb", "0.01,5", "--iters", "2"], "would add 2 configuration(s)"),
                           (["--bucket-mb", "0.01,1", "--iters", "3"], "would add 4 configuration(s)"),
                           (["--bucket-mb", "0.01,1", "--iters", "2", "--repeat", "2"], "--repeat 2 where the run has 1")):
        result = sweep(*extra, "--out", tmp_path, "--name", "run", "--resume")
        assert result.exit_code == 2 and message in result.output and "--force" in result.output, result.output
    assert sorted(p.name for p in run_dir.iterdir()) == ["configs", "metadata.json"]  # nothing ran or changed


@pytest.mark.slow
def test_sigterm_then_resume(tmp_path):
    args = ["sweep", "--bucket-mb", "0.01,1", *TINY, "--out", str(tmp_path), "--name", "killed",
            "--no-figures", "--timeout", "120"]
    configs = tmp_path / "killed" / "configs"
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    proc = subprocess.Popen([sys.executable, "-c", "from commlab.cli import main; main()", *args],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            env={**os.environ, "TMPDIR": str(scratch)})
    try:
        deadline = time.monotonic() + 120
        while not list(configs.glob("*.json")) and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.05)
        time.sleep(0.5)  # into the second configuration's launch
        os.kill(proc.pid, signal.SIGTERM)  # the driver only, as a batch system's scancel would
        _, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 143, stderr
    assert "interrupted: partial results in" in stderr and "rerun with --resume to continue" in stderr
    assert _session_gone(proc.pid), subprocess.run(["ps", "-o", "pid,ppid,args", "-s", str(proc.pid)],
                                                   capture_output=True, text=True).stdout  # no rank outlived it
    assert not [p for p in scratch.iterdir() if p.name.startswith("commlab-")]  # rendezvous dirs removed
    before = {p.name: p.read_bytes() for p in configs.glob("*.json")}
    assert len(before) == 1, "the sweep should have been ended during its second configuration"
    assert json.loads((tmp_path / "killed" / "metadata.json").read_text())["sessions"][0]["interrupted"]

    # Resume with the torchrun launcher: same configuration ids, same result format.
    result = CliRunner().invoke(main, [*args, "--resume", "--launcher", "torchrun"])  # launcher is not part of the grid
    assert result.exit_code == 0, result.output
    assert "1 of 2 configurations already finished" in result.output
    for name, content in before.items():  # finished configurations were not rerun
        assert (configs / name).read_bytes() == content
    runs = pd.read_csv(tmp_path / "killed" / "runs.csv")
    assert len(runs) == 2 and runs["config"].is_unique and (runs["status"] == "ok").all()
    # World size 1 on this machine would get every core under cpu_count // world_size (local) or
    # OMP_NUM_THREADS=1 (torchrun): both launchers measure with the configuration's one thread.
    assert (runs["threads"] == 1).all() and (runs["threads_measured"] == 1).all()
    iterations = pd.read_csv(tmp_path / "killed" / "iterations.csv")
    assert len(iterations) == 2 * 2 and not iterations.duplicated(["config", "rank", "iteration"]).any()
    buckets = pd.read_csv(tmp_path / "killed" / "buckets.csv")
    counts = buckets.groupby("bucket_mb")["bucket"].nunique()
    assert counts[0.01] > counts[1.0] == 1  # smaller caps, more buckets (and both launchers agree on the format)
    assert (buckets.groupby(["config", "iteration"])["nbytes"].sum() == MLP_BYTES).all()
    assert len(json.loads((tmp_path / "killed" / "metadata.json").read_text())["sessions"]) == 2
    assert not [p for p in configs.iterdir() if p.suffix != ".json"]  # no temp files left behind
