"""Running a function on N local ranks (or on this torchrun rank) without ever hanging the caller.

The local launcher spawns one process per rank, rendezvouses them through a FileStore in a
private temporary directory (no listening socket at all) and pins Gloo's transport to the
loopback interface, so nothing binds outside this machine. Every rank reports its result or its
traceback through a queue; the parent kills every child when one fails or the deadline passes.
A parent killed outright (SIGKILL) takes its ranks and its directory with it
(:mod:`commlab.runtime.orphans`).

Under torchrun the same call initialises from the environment and runs ``fn`` on this rank only,
so multi-node jobs go through torchrun rather than through anything home-made.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue
import signal
import time
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from commlab.runtime import rank_entry
from commlab.runtime.context import init_from_env, resolve_backend, under_torchrun
from commlab.runtime.orphans import Terminated, private_tempdir, sigterm_as_interrupt  # noqa: F401 (public here too)


class LaunchError(RuntimeError):
    """A rank failed, died or did not finish in time; carries the failing rank's traceback."""

    def __init__(self, message: str, rank: int | None = None, remote_traceback: str = ""):
        super().__init__(message + (f"\n\n--- rank {rank} traceback ---\n{remote_traceback}" if remote_traceback else ""))
        self.rank = rank
        self.remote_traceback = remote_traceback


def launch(
    fn: Callable[..., Any],
    *args: Any,
    world_size: int | None = None,
    backend: str = "auto",
    timeout: float = 120.0,
) -> list[Any]:
    """Run ``fn(*args)`` on every rank and return the ranks' results in rank order.

    ``fn`` must be importable by name (defined at module level) because ranks are spawned.
    Raises :class:`LaunchError` with the first failing rank's traceback, or when the ranks have
    not all finished within ``timeout`` seconds; no child process outlives the call.

    Under torchrun, ``fn`` runs in this process, every rank's result is gathered, and the default
    process group stays initialised afterwards: the torchrun script owns it (call
    ``dist.destroy_process_group()`` when done), so several launches can share one job.
    """
    if timeout <= 0:
        raise ValueError(f"timeout must be positive, got {timeout}")
    if under_torchrun():
        env_world = int(os.environ["WORLD_SIZE"])
        if world_size is not None and world_size != env_world:
            raise ValueError(f"world_size={world_size} but torchrun started {env_world} ranks")
        init_from_env(backend, timeout)
        result = fn(*args)
        gathered: list[Any] = [None] * env_world
        dist.all_gather_object(gathered, result)
        return gathered
    world_size = 1 if world_size is None else world_size
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive integer, got {world_size!r}")
    chosen = resolve_backend(backend, world_size)
    return _spawn(fn, args, world_size, chosen, timeout)


def _spawn(fn, args, world_size: int, backend: str, timeout: float) -> list[Any]:
    ctx = mp.get_context("spawn")
    results: dict[int, Any] = {}
    with private_tempdir("commlab-") as tmp:
        store_path = os.path.join(tmp, "store")
        q = ctx.Queue()
        # The work travels as bytes that the rank unpickles (importing torch) only after it has
        # set its parent-death signal; see commlab.runtime.rank_entry.
        payload = pickle.dumps((world_size, backend, store_path, timeout, fn, args))
        procs = [
            ctx.Process(target=rank_entry.start_rank, args=(rank, payload, q, os.getpid()), name=f"commlab-rank{rank}")
            for rank in range(world_size)
        ]
        try:  # started inside the try: an interrupt between two starts still ends the first
            for p in procs:
                p.start()
            _collect(procs, q, results, time.monotonic() + timeout, timeout)
        finally:
            _terminate(procs)
            q.close()
    return [results[r] for r in range(world_size)]


def _collect(procs, q, results: dict[int, Any], deadline: float, timeout: float) -> None:
    exited_at: dict[int, float] = {}
    while len(results) < len(procs):
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            missing = sorted(set(range(len(procs))) - set(results))
            raise LaunchError(f"ranks {missing} did not finish within {timeout:g} s")
        try:
            rank, ok, payload = q.get(timeout=min(0.1, remaining))
        except queue.Empty:
            now = time.monotonic()
            for rank, p in enumerate(procs):
                if rank in results or p.is_alive():
                    continue
                # A clean exit may still have its result in the queue's pipe: give it a moment.
                exited_at.setdefault(rank, now)
                if p.exitcode != 0 or now - exited_at[rank] > 5.0:
                    raise LaunchError(exit_reason(rank, p.exitcode), rank)
            continue
        if not ok:
            raise _cause(procs, rank, payload)
        results[rank] = pickle.loads(payload)


def _cause(procs, rank: int, payload: str, grace: float = 0.2) -> LaunchError:
    """The error for a rank that reported a failure, unless a peer died without a word: a peer's
    hard exit (os._exit, a signal) breaks the others' rendezvous or collectives ("connection
    closed by peer"), and the rank that reports first is then only the symptom. The dead peer's
    exit code is visible at once, so a short look suffices."""
    end = time.monotonic() + grace
    while True:
        for other, p in enumerate(procs):
            if other != rank and p.exitcode not in (None, 0):
                symptom = payload.strip().splitlines()[-1] if payload.strip() else "failed"
                return LaunchError(f"{exit_reason(other, p.exitcode)} (then rank {rank}: {symptom})", other)
        if time.monotonic() >= end:
            return LaunchError(f"rank {rank} failed", rank, payload)
        time.sleep(0.02)


def exit_reason(rank: int, exitcode: int | None) -> str:
    """Why a rank that never reported may have gone: a signal's name, or what an exit code means."""
    head = f"rank {rank} exited with code {exitcode} before reporting a result"
    if exitcode is not None and exitcode < 0:
        name = signal.Signals(-exitcode).name if -exitcode in signal.valid_signals() else f"signal {-exitcode}"
        why = {"SIGKILL": "killed by SIGKILL: often the kernel's out-of-memory killer (see dmesg), or a kill -9",
               "SIGSEGV": "crashed with SIGSEGV: a segmentation fault in native code (torch, a backend, an extension)",
               "SIGTERM": "ended by SIGTERM from outside the launcher",
               "SIGABRT": "aborted (SIGABRT): a native assertion or std::terminate; its message is on stderr"}
        return f"{head}: {why.get(name, f'ended by {name}')}"
    if exitcode == 0:
        return (f"{head}: it exited cleanly without returning from the launched function "
                "(sys.exit(0) or os._exit(0) inside it?)")
    return (f"{head}: the process ended without raising a Python exception (os._exit({exitcode}), "
            "sys.exit in a C extension, or a fatal error printed on stderr)")


def _terminate(procs) -> None:
    procs = [p for p in procs if p.pid is not None]  # started ones only
    for p in procs:
        if p.is_alive():
            p.terminate()
    end = time.monotonic() + 3.0
    for p in procs:
        p.join(max(0.0, end - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join()
