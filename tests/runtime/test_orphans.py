"""A launcher killed outright (SIGKILL) leaves no rank and no temporary directory behind."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from commlab.runtime.orphans import dies_with_parent, private_tempdir

pytestmark = pytest.mark.slow  # every test here starts processes

# The parent: two ranks that write their pid, then sleep far past the test.
PARENT = """
import os, sys, time
import commlab

def rank(pid_dir):
    open(os.path.join(pid_dir, str(os.getpid())), "w").close()
    time.sleep(600)

if __name__ == "__main__":
    commlab.launch(rank, sys.argv[1], world_size=2, backend="gloo", timeout=600)
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A killed child not yet reaped by init is a zombie: it has ended.
    return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z" if Path(f"/proc/{pid}").exists() else False


def _wait(condition, seconds: float) -> bool:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if condition():
            return True
        time.sleep(0.1)
    return condition()


def test_a_killed_launcher_takes_its_ranks_and_its_rendezvous_directory(tmp_path):
    pids, tmp = tmp_path / "pids", tmp_path / "tmp"
    pids.mkdir()
    tmp.mkdir()
    script = tmp_path / "parent.py"
    script.write_text(PARENT)
    env = {**os.environ, "TMPDIR": str(tmp), "PYTHONPATH": os.pathsep.join(sys.path)}
    parent = subprocess.Popen([sys.executable, str(script), str(pids)], env=env)
    try:
        assert _wait(lambda: len(list(pids.iterdir())) == 2, 120), "the ranks did not start"
        assert [p.name for p in tmp.iterdir() if p.name.startswith("commlab-")]  # the rendezvous directory
        ranks = [int(p.name) for p in pids.iterdir()]
        assert all(_alive(pid) for pid in ranks)
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        assert _wait(lambda: not any(_alive(pid) for pid in ranks), 10), "a rank outlived its parent"
        assert _wait(lambda: not [p for p in tmp.iterdir() if p.name.startswith("commlab-")], 10), list(tmp.iterdir())
    finally:
        parent.kill()
        parent.wait()


def test_a_command_dies_with_its_parent_and_the_tempdir_goes_on_a_normal_exit(tmp_path):
    with private_tempdir("commlab-test-") as path:
        assert os.path.isdir(path)
    assert not os.path.exists(path)
    # A middle process starts `sleep` with dies_with_parent, prints its pid and is killed.
    middle = ("import subprocess, sys\nfrom commlab.runtime.orphans import dies_with_parent\n"
              "p = subprocess.Popen(['sleep', '600'], preexec_fn=dies_with_parent())\nprint(p.pid, flush=True)\n"
              "import time; time.sleep(600)\n")
    proc = subprocess.Popen([sys.executable, "-c", middle], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    try:
        child = int(proc.stdout.readline())
        assert _alive(child)
        proc.kill()
        proc.wait()
        assert _wait(lambda: not _alive(child), 10)
    finally:
        proc.kill()
        proc.wait()
    assert callable(dies_with_parent())
