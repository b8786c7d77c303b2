"""The peak-memory measurement prints nothing of the profiler's: not in a window, not in a sweep's console."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from commlab.memtrack import PROFILER_CHATTER, track_peak

ROOT = Path(__file__).resolve().parents[2]


def test_a_cpu_window_keeps_its_own_output_and_drops_the_profilers(capfd):
    before = torch.empty(1 << 16)  # allocated before the window, freed in it: c10 warns about that
    with track_peak("cpu") as peak:
        del before
        os.write(2, b"a line of the caller's own\n")
        torch.empty(1 << 18)
    out, err = capfd.readouterr()
    assert peak.peak_bytes >= 1 << 20  # still measured
    assert "a line of the caller's own" in err  # the window hides nothing else
    for text in (out, err):
        assert "USDT" not in text and "profiler_start" not in text
        assert not any(mark.decode() in text for mark in PROFILER_CHATTER), text


@pytest.mark.slow
def test_the_sweeps_console_holds_no_profiler_or_allocator_lines(tmp_path):
    """One small configuration at world size 2: its ranks measure the peak (the console's `peak`)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(
        [sys.executable, "-m", "commlab.cli", "sweep", "--model-args", "depth=2,width=64", "--bucket-mb", "1",
         "--overlap", "on", "--iters", "1", "--warmup", "0", "--global-batch", "8", "--no-figures",
         "--out", str(tmp_path), "--name", "quiet"],
        capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "peak " in proc.stderr  # the summary line: the peak was measured
    for text in (proc.stdout, proc.stderr):
        assert "USDT" not in text and "profiler_st" not in text, text
        assert "CPUAllocator" not in text and "Memory block of unknown size" not in text, text
