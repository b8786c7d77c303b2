"""What every test shares: the layout's import rule, and the guard that keeps the `slow` mark true.

Layout. tests/ mirrors commlab/ (tests/ddp, tests/costmodel/<room>, tests/sweep, ...), with the
project-wide checks (architecture, imports, docs, README) at the top. What two test files share
lives in tests/support; no test module imports another.

Why every test folder is a package (an ``__init__.py``) rather than ``--import-mode=importlib``:
a rank is a spawned process that unpickles the function it runs by its module's dotted name, so
a test module or a support module must be importable under one name in a fresh interpreter. With
packages, pytest's default "prepend" mode puts the repository root on ``sys.path`` (the ranks
inherit it) and names each file by its path, ``tests.ddp.test_ddp``: two ``test_cli.py`` in two
folders do not collide, and a rank imports ``tests.support.ddp_cases`` as the test did.
importlib mode leaves ``sys.path`` alone, so a rank could not import what the test defined.

slow. A test that starts a process (a rank, a ``commlab`` or Python subprocess) costs seconds;
it carries ``@pytest.mark.slow``, and ``python -m pytest -m "not slow"`` is the in-process run.
The guard below keeps the mark from rotting: in a test not marked slow, starting a
multiprocessing process, or a subprocess that runs Python, ``commlab`` or ``torchrun``, fails
the test (in its setup, call or teardown, so module-scoped fixtures count). Other programs (git
for run metadata, say) take milliseconds and stay allowed.
"""

from __future__ import annotations

import pytest

from tests.support.spawn_guard import TRIPPED, guarded


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item):
    with guarded(item, "setup"):
        yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    with guarded(item, "call"):
        yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item):
    with guarded(item, "teardown"):
        yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A refused start fails the test even where the code under test swallowed the failure."""
    outcome = yield
    report = outcome.get_result()
    phase, message = item.stash.get(TRIPPED, (None, None))
    if phase == call.when and report.passed:
        report.outcome, report.longrepr = "failed", message

