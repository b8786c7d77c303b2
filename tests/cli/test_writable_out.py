"""An --out that cannot be written is a usage error before any work (no calibration, no rank)."""

import os
from pathlib import Path

import pytest
from click.testing import CliRunner

import commlab
from commlab.cli import main


@pytest.fixture
def read_only(tmp_path):
    """A directory this process cannot write in. Root writes through permission bits, so for
    root (as in CI containers) /proc/self stands in: no file can be created there by anyone."""
    if os.geteuid() != 0:
        path = tmp_path / "ro"
        path.mkdir()
        path.chmod(0o555)
        yield path
        path.chmod(0o755)
        return
    if not Path("/proc/self").is_dir():
        pytest.skip("running as root without /proc: no directory root cannot write")
    yield Path("/proc/self")


@pytest.fixture
def nothing_runs(monkeypatch):
    from commlab.costmodel.calibration import driver as cal

    def refuse(*_a, **_k):
        raise AssertionError("work started before --out was checked")

    monkeypatch.setattr(cal, "calibrate", refuse)
    monkeypatch.setattr(commlab, "launch", refuse)
    monkeypatch.setattr("commlab.runtime.launch.launch", refuse)


def invoke(*args):
    return CliRunner().invoke(main, list(map(str, args)))


@pytest.mark.parametrize("command", [
    ["sweep", "--model-args", "depth=2,width=64"],
    ["predict", "--model-args", "depth=2,width=64", "--profile", "{tmp}/p.json"],
    ["bench", "collectives"],
    ["pipeline", "bench"],
])
def test_a_read_only_out_is_refused_before_any_work(command, read_only, nothing_runs, tmp_path):
    args = [a.replace("{tmp}", str(tmp_path)) for a in command]
    r = invoke(*args, "--out", read_only / "results")
    assert r.exit_code == 2, r.output
    assert "cannot write in" in r.output and "Traceback" not in r.output
    assert not (tmp_path / "p.json").exists()


def test_an_out_under_a_regular_file_is_refused(tmp_path, nothing_runs):
    (tmp_path / "notes.txt").write_text("a file, not a directory")
    for command in (["sweep"], ["predict", "--profile", tmp_path / "p.json"]):
        r = invoke(*command, "--out", tmp_path / "notes.txt" / "results")
        assert r.exit_code == 2 and "is a file" in r.output and "Traceback" not in r.output, r.output
    assert not (tmp_path / "p.json").exists()


def test_a_writable_out_leaves_no_probe_behind(tmp_path):
    from commlab.cli.writable import check_writable

    check_writable(tmp_path / "new" / "deeper")
    assert list(tmp_path.iterdir()) == []  # nothing created by the check itself
