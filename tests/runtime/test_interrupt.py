"""Ctrl-C in a measuring command: the rows measured so far kept, one line saying where, exit 130."""

import os
import signal
import subprocess
import sys
import time

import click
import pandas as pd
import pytest
from click.testing import CliRunner

from commlab._atomic import write_text
from commlab.runtime.interrupt import keep_partial


def _command(interrupt, rows_before):
    @click.command()
    def measure():
        rows = []

        def save():
            if not rows:
                return None
            write_text("partial.csv", "\n".join(rows) + "\n")
            return "partial.csv"

        with keep_partial(save, resume="rerun to continue" if rows_before else ""):
            for i in range(5):
                if i == rows_before:
                    interrupt()
                rows.append(f"row{i}")
        click.echo("finished")

    return measure


def _ctrl_c():
    raise KeyboardInterrupt


def _sigterm():
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(5)  # the handler raises before this ends


def test_keep_partial_saves_says_where_and_exits_130_or_143(tmp_path, monkeypatch):
    runner = CliRunner()
    monkeypatch.chdir(tmp_path)
    result = runner.invoke(_command(_ctrl_c, 3), [])
    assert result.exit_code == 130 and "finished" not in result.output
    assert result.output.strip() == "interrupted: partial results in partial.csv; rerun to continue"
    assert open("partial.csv").read().split() == ["row0", "row1", "row2"]
    os.remove("partial.csv")
    result = runner.invoke(_command(_ctrl_c, 0), [])
    assert result.exit_code == 130 and result.output.strip() == "interrupted: nothing measured yet"
    assert not os.path.exists("partial.csv")
    result = runner.invoke(_command(_sigterm, 2), [])
    assert result.exit_code == 143 and open("partial.csv").read().split() == ["row0", "row1"]
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # the handler is only inside the block
    assert runner.invoke(_command(lambda: None, 2), []).output.strip() == "finished"


@pytest.mark.slow
def test_bench_collectives_interrupted_keeps_the_sizes_measured(tmp_path):
    out = tmp_path / "out"
    args = ["bench", "collectives", "-b", "1K", "-e", "1G", "-f", "2", "-n", "1", "-w", "0", "--algorithm", "native",
            "--out", str(out), "--timeout", "300", "--oversubscribe"]  # 1G: it never finishes here
    proc = subprocess.Popen([sys.executable, "-c", "from commlab.cli import main; main()", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        shown = []
        for line in proc.stdout:  # wait for three sizes' rows, then Ctrl-C the whole process group
            shown += [line] if line.split()[:1] and line.split()[0].isdigit() else []
            if len(shown) == 3:
                break
        os.killpg(proc.pid, signal.SIGINT)
        _, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 130, stderr
    df = pd.read_csv(out / "collectives.csv")
    assert len(df) >= 2 * 3 and {1024, 2048, 4096} <= set(df["size_bytes"]) and (df["wrong"] == 0).all()
    assert f"interrupted: partial results in {out / 'collectives.csv'} ({len(df)} rows)" in stderr
    assert "Traceback" not in stderr and not (out / ".collectives.partial.csv").exists()
