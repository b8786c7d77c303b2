"""The guard behind the `slow` mark (tests/conftest.py): a process started in a test not marked
slow fails that test, and nothing else does."""

import multiprocessing
import subprocess
import sys

import pytest

from tests.support.spawn_guard import TRIPPED, starts_python


def test_what_counts_as_starting_python():
    assert starts_python([sys.executable, "-c", "pass"]) and starts_python(["python3.11", "-m", "commlab"])
    assert starts_python(["commlab", "sweep"]) and starts_python(["/usr/local/bin/torchrun", "x.py"])
    assert starts_python("PYTHONPATH=. python -m pytest", shell=True)
    assert starts_python(["env", "A=1", "python", "-c", "pass"]) and starts_python(["timeout", "5", "commlab"])
    assert starts_python(["anything"], executable=sys.executable)
    assert starts_python(["bash", "-e", "-c", "cd x\ncommlab sweep --bucket-mb 5 && ls"])
    # git on a path that ends in commlab is git, and so is a program merely named like python's files
    assert not starts_python(["git", "-C", "/work/commlab", "rev-parse", "HEAD"])
    assert not starts_python(["sleep", "1"]) and not starts_python("ls -l commlab_notes", shell=True)
    assert not starts_python(["python-config-viewer"]) and not starts_python("true")


def test_a_process_started_by_a_test_not_marked_slow_fails_it(request):
    with pytest.raises(pytest.fail.Exception, match=r"starts a process \(.*\) but is not marked slow"):
        multiprocessing.get_context("spawn").Process(target=print).start()
    with pytest.raises(pytest.fail.Exception, match=r"runs .* but is not marked slow"):
        subprocess.run([sys.executable, "-c", "pass"])
    assert request.node.stash[TRIPPED][0] == "call"
    del request.node.stash[TRIPPED]  # refused on purpose: the test passes if both were refused
    assert subprocess.run(["true"]).returncode == 0  # other programs stay allowed


@pytest.mark.slow
def test_a_slow_test_may_start_python():
    assert subprocess.run([sys.executable, "-c", "pass"]).returncode == 0
