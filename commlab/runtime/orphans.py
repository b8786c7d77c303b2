"""Nothing outlives a killed launcher: children die with it, its temporary directories go too.

A parent ended by SIGKILL (the out-of-memory killer, ``kill -9``) runs no ``finally``: its
children would keep running and its temporary directories would stay. Two Linux mechanisms
close that gap without any cooperation from the dying parent:

- ``prctl(PR_SET_PDEATHSIG, SIGKILL)`` in a child asks the kernel to kill it when its parent
  dies (prctl(2)); it survives ``execve``, so it can be set between fork and exec of a command.
- a reaper: a tiny process in its own session that holds the read end of a pipe whose write end
  only the parent has. When the parent dies, however it dies, the kernel closes the write end,
  the reaper reads end-of-file and removes the directory.

A SIGTERM (a batch system's, ``kill``'s) is the polite case: :func:`sigterm_as_interrupt` turns it
into an exception so that every ``finally`` runs. Imports nothing heavy: spawned ranks call
:func:`set_parent_death_signal` before importing torch.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>

# Run by the reaper: wait for the parent's end of the pipe to close, then remove the directory.
_REAPER = "import shutil, sys\nsys.stdin.buffer.read()\nshutil.rmtree(sys.argv[1], ignore_errors=True)\n"


def set_parent_death_signal(expected_parent: int | None = None) -> None:
    """Ask Linux to SIGKILL this process when its parent dies (a no-op elsewhere).

    With ``expected_parent``, a parent that died before the call (this process already
    reparented) ends this process at once: the kernel would never send the signal then.
    """
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:  # not Linux: the parent's own cleanup still applies
        return
    if expected_parent is not None and os.getppid() != expected_parent:
        os._exit(1)


def dies_with_parent() -> Callable[[], None]:
    """A ``preexec_fn`` for :class:`subprocess.Popen`: the command dies with this process.

    Call it on the thread that starts the command and keeps running: Linux sends the signal
    when the thread that forked the child ends, not only the process.
    """
    parent = os.getpid()
    return lambda: set_parent_death_signal(parent)


@contextlib.contextmanager
def private_tempdir(prefix: str) -> Iterator[str]:
    """A temporary directory removed on exit, and by a reaper if this process is killed first."""
    path = tempfile.mkdtemp(prefix=prefix)
    reaper = None
    try:
        # Its own session: a Ctrl-C to the terminal's process group must not end it before the
        # parent has finished. close_fds (the default) keeps the pipe's write end in this process.
        reaper = subprocess.Popen([sys.executable, "-I", "-S", "-c", _REAPER, path], stdin=subprocess.PIPE,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)
        if reaper is not None:
            reaper.stdin.close()  # the reaper finds nothing left and exits
            with contextlib.suppress(subprocess.TimeoutExpired):
                reaper.wait(timeout=5.0)


@contextlib.contextmanager
def sigterm_as_interrupt():
    """Inside the block, SIGTERM raises :class:`Terminated` (a KeyboardInterrupt) like Ctrl-C.

    A batch system or ``kill`` ends a job with SIGTERM; its default action would kill this
    process at once, skipping every ``finally``: ranks left running, temporary directories left
    behind. As an exception it unwinds like Ctrl-C, so :func:`commlab.launch` ends its ranks and
    removes its rendezvous directory. Main thread only (Python delivers signals there).
    """
    def handler(signum, frame):
        raise Terminated()

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


class Terminated(KeyboardInterrupt):
    """SIGTERM received inside :func:`sigterm_as_interrupt`; exit status 128 + 15 by convention."""

    exit_code = 128 + signal.SIGTERM
