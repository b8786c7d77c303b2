"""The guard behind the `slow` mark: in a test not marked slow, starting a process fails the test.

tests/conftest.py wires it around every test's setup, call and teardown and says why.
"""

from __future__ import annotations

import contextlib
import multiprocessing.process
import os
import re
import shlex
import subprocess
import sys

import pytest

# Programs whose start means an interpreter importing commlab (and usually torch): seconds.
_PYTHON_PROGRAM = re.compile(r"python[0-9.]*|commlab|torchrun")
# Programs that run another program named in their arguments.
_WRAPPERS = {"sh", "bash", "env", "timeout", "flock", "nice"}
_SHELL_WORD = re.compile(r"[^\s;&|()<>'\"`=]+")
TRIPPED = pytest.StashKey[tuple[str, str]]()  # (phase, message) of a refused start


def _words(args, shell: bool) -> list[str]:
    if isinstance(args, (str, bytes, os.PathLike)):
        text = os.fsdecode(args)
        return shlex.split(text) if shell else [text]
    return [os.fsdecode(a) for a in args]


def _is_python(word: str) -> bool:
    if os.path.realpath(word) == os.path.realpath(sys.executable):
        return True
    return _PYTHON_PROGRAM.fullmatch(os.path.basename(word)) is not None


def starts_python(args, *, executable=None, shell: bool = False) -> bool:
    """Whether ``subprocess.Popen(args, executable=..., shell=...)`` would start Python, ``commlab`` or
    ``torchrun`` (directly, or through a shell or a wrapper such as ``env`` or ``timeout``)."""
    words = _words(args, shell)
    program = os.fsdecode(executable) if executable else (words[0] if words else "")
    if _is_python(program):
        return True
    if shell or os.path.basename(program) in _WRAPPERS:  # a script's words: `bash -c "commlab sweep ..."`
        return any(_is_python(w) for w in _SHELL_WORD.findall(" ".join(words)))
    return False


@contextlib.contextmanager
def refuse_processes(item: pytest.Item, phase: str):
    """Patch the two doors processes leave by, for the duration of one phase of ``item``."""
    def refuse(what: str):
        message = (f"{item.nodeid} {what} but is not marked slow: add @pytest.mark.slow "
                   "(tests/conftest.py), so that `pytest -m 'not slow'` stays in-process")
        item.stash[TRIPPED] = (phase, message)
        pytest.fail(message, pytrace=False)  # BaseException: an `except Exception` in the code under test lets it by

    original_start, original_init = multiprocessing.process.BaseProcess.start, subprocess.Popen.__init__

    def start(self):
        refuse(f"starts a process ({self.name})")

    def init(self, args, *rest, **kwargs):
        shell = bool(kwargs.get("shell"))
        if starts_python(args, executable=kwargs.get("executable"), shell=shell):
            refuse(f"runs `{' '.join(_words(args, shell)[:3])} ...`")
        original_init(self, args, *rest, **kwargs)

    multiprocessing.process.BaseProcess.start, subprocess.Popen.__init__ = start, init
    try:
        yield
    finally:
        multiprocessing.process.BaseProcess.start, subprocess.Popen.__init__ = original_start, original_init


def guarded(item: pytest.Item, phase: str):
    if item.get_closest_marker("slow") is not None:
        return contextlib.nullcontext()
    return refuse_processes(item, phase)
