"""`commlab pipeline`: show and simulate print what the pure functions compute; bench writes its
tidy CSVs and figures (one small launch) and rejects bad options before starting any process."""

import pandas as pd
import pytest
from click.testing import CliRunner

from commlab.cli import main
from commlab.pipeline import build, grid


def _run(*args):
    return CliRunner().invoke(main, ["pipeline", *args], catch_exceptions=False)


def test_show_prints_the_grid_and_actions():
    out = _run("show", "--schedule", "1f1b", "-p", "4", "-m", "8")
    assert out.exit_code == 0 and out.output.strip() == grid(build("1f1b", 4, 8))
    out = _run("show", "--schedule", "interleaved", "-p", "2", "-m", "4", "-v", "2", "--actions")
    assert out.output.splitlines()[0] == "rank 0: 0F0 0F1 2F0 2F1 0F2 2B0 0F3 2B1 2F2 0B0 2F3 0B1 2B2 2B3 0B2 0B3"
    # --comm: the lists after the comm pass, the executor's own.
    out = _run("show", "--schedule", "gpipe", "-p", "2", "-m", "1", "--comm", "nccl")
    assert out.output.splitlines() == ["rank 0: 0F0 SEND(0F0>1F0) RECV(1B0>0B0) WAIT(SEND 0F0>1F0) WAIT(RECV 1B0>0B0) 0B0",
                                       "rank 1: RECV(0F0>1F0) WAIT(RECV 0F0>1F0) 1F0 1B0 SEND(1B0>0B0) WAIT(SEND 1B0>0B0)"]
    bad = CliRunner().invoke(main, ["pipeline", "show", "--schedule", "interleaved", "-p", "4", "-m", "6"])
    assert bad.exit_code == 2 and "multiple of the ranks" in bad.output


def test_simulate_reports_bubbles(tmp_path):
    out = _run("simulate", "-p", "4", "-m", "8", "--figure", str(tmp_path / "g.png"))
    lines = {line.split()[0]: line.split() for line in out.output.splitlines()[1:4]}
    assert lines["gpipe"][3] == "0.273" and lines["1f1b"][3] == "0.273"  # 3 / 11
    assert lines["interleaved"][3] == "0.158"  # 3 / (2 * 8 + 3)
    assert (tmp_path / "g.png").stat().st_size > 0


def test_bench_rejects_bad_options_before_launching():
    for args, message in [
        (["--schedules", "zb"], "choose from"),
        (["--microbatches", "0"], "positive integers"),
        (["--microbatches", "3", "--schedules", "interleaved"], "multiple of the ranks"),
        (["--microbatches", "80", "--batch", "64"], "batch of at least 80"),
        (["--checkpoint", "sometimes"], "choose from"),
        (["--backend", "nccl"], "CUDA device"),
    ]:
        result = CliRunner().invoke(main, ["pipeline", "bench", *args])
        if message == "CUDA device" and "CUDA device" not in result.output and result.exit_code == 0:
            continue  # a machine with GPUs accepts nccl
        assert result.exit_code == 2 and message in result.output, (args, result.output)


@pytest.mark.slow
def test_bench_writes_tidy_results_and_figures(tmp_path):
    args = ["bench", "--schedules", "gpipe,1f1b", "-m", "2,4", "--checkpoint", "never,always", "--depth", "2",
            "--width", "16", "--batch", "8", "--iters", "2", "--warmup", "1", "--out", str(tmp_path), "--name", "r"]
    out = _run(*args)
    assert out.exit_code == 0, out.output
    run = tmp_path / "r"
    summary = pd.read_csv(run / "summary.csv")
    assert len(summary) == 8 and set(summary["schedule"]) == {"gpipe", "1f1b"}
    plain = summary[summary["checkpoint"] == "never"]
    assert plain["ratio"].notna().all() and summary[summary["checkpoint"] == "always"]["ratio"].isna().all()
    for column in ("bubble_measured", "idle_waiting", "idle_data_ready", "bubble_simulated", "bubble_replayed"):
        assert ((summary[column] >= 0) & (summary[column] < 1)).all(), column
    assert plain["bubble_formula"].tolist()[:2] == pytest.approx([1 / 3, 1 / 5])  # gpipe, m = 2 and 4
    assert (summary["predicted_s"] > 0).all() and summary["prediction_error"].notna().all()
    stages = pd.read_csv(run / "stages.csv")
    first = stages[(stages["stage"] == 0) & (stages["checkpoint"] == "never")].set_index(["schedule", "microbatches"])
    # 1F1B keeps p = 2 of m = 4 micro-batches on stage 0, GPipe all four.
    assert first.loc[("1f1b", 4), "saved_bytes"] / first.loc[("gpipe", 4), "saved_bytes"] == pytest.approx(0.5)
    timeline = pd.read_csv(run / "timeline.csv")
    assert set(timeline["source"]) == {"measured", "simulated"}
    assert (run / "metadata.json").stat().st_size > 0
    # The figures go under the run's figures/ directory, none beside the CSVs.
    assert all((run / "figures" / f).stat().st_size > 0 for f in ("throughput.png", "activation_memory.png", "peak_memory.png",
                                                                  "timeline.png"))  # fmt: skip
    assert not list(run.glob("*.png")) and not (run / ".partial").exists()
    # The figure of peak memory per schedule is drawn from each rank's ledger peak: GPipe's above 1F1B's.
    peaks = stages[stages["checkpoint"] == "never"].groupby(["schedule", "microbatches"])["rank_peak_bytes"].max()
    assert peaks[("1f1b", 4)] < peaks[("gpipe", 4)]
    assert not list(run.glob(".*.tmp"))  # atomic writes leave no temporary files


@pytest.mark.slow
def test_interrupted_bench_keeps_the_rows_measured_and_exits_130(tmp_path, monkeypatch):
    import commlab

    real = commlab.launch

    def first_then_interrupt(fn, configs, common, **kwargs):
        real(fn, configs[:1], common, **kwargs)  # the first configuration finishes on every rank ...
        raise KeyboardInterrupt  # ... then Ctrl-C

    monkeypatch.setattr(commlab, "launch", first_then_interrupt)
    args = ["bench", "--schedules", "gpipe,1f1b", "-m", "2", "--depth", "2", "--width", "16", "--batch", "8",
            "--iters", "1", "--warmup", "0", "--calibrate", "1", "--out", str(tmp_path), "--name", "r"]  # fmt: skip
    out = CliRunner().invoke(main, ["pipeline", *args])
    assert out.exit_code == 130, out.output
    assert "Aborted" not in out.output and "interrupted: 1 of 2 configurations measured" in out.output
    assert str(tmp_path / "r") in out.output
    summary = pd.read_csv(tmp_path / "r" / "summary.csv")
    assert summary["config"].tolist() == ["gpipe-m2-time-never"] and (summary["commlab_s"] > 0).all()
    assert not (tmp_path / "r" / ".partial").exists() and not list((tmp_path / "r").glob(".*.tmp"))


def test_simulate_skips_default_schedules_m_cannot_fill_but_refuses_named_ones():
    out = _run("simulate", "-p", "4", "-m", "4")  # dualpipev needs m >= its 8 stages
    assert out.exit_code == 0, out.output
    assert "skipped dualpipev at m=4" in out.output and "\ninterleaved-zb " in out.output
    named = CliRunner().invoke(main, ["pipeline", "simulate", "-p", "4", "-m", "4", "--schedules", "dualpipev"])
    assert named.exit_code == 2 and "at least as many micro-batches" in named.output
