"""Peak memory of a window of work: bytes allocated minus freed since its start, at their highest.

:func:`track_peak` measures a window; :func:`live_bytes` gives what is allocated at its start,
so a step's peak is ``live_bytes(device)`` at entry plus the window's ``peak_bytes``.

- CUDA: the caching allocator's own counters (``torch.cuda.reset_peak_memory_stats`` and
  ``max_memory_allocated`` relative to ``memory_allocated`` at entry; torch/cuda/memory.py):
  exact, every stream and thread, no cost.
- CPU: torch has no allocator counters, so the window runs under ``torch.profiler`` with
  ``profile_memory=True`` (CPU activity only) and replays its allocation events: c10's CPU
  allocator reports every allocation and free of the window's thread with its size
  (c10/core/CPUAllocator.cpp, ``ProfiledCPUMemoryReporter``). That is exact where it sees: it
  counts what a ``TorchDispatchMode`` would miss (a storage resized in place, as stage 3 frees
  and re-gathers its buckets; buffers an operator allocates inside itself, e.g. a collective's
  output or autograd's gradient accumulation) at the cost of the profiler's per-operator
  record while on (opt-in: never around timed steps). Threads: autograd's CPU work runs on the
  calling thread, and Gloo's asynchronous collectives run with the thread-local state of the
  thread that issued them (ProcessGroupGloo's AsyncWork carries it, ProcessGroupGloo.hpp), so
  their allocations are seen; other threads' are not (commlab's p2p collective worker). Close a
  window only after the collectives issued inside it have completed: a Gloo work still running
  with the window's profiler state when it stops crashed a rank (SIGSEGV, 1 run in 6 of a
  stage-1 step whose all-gathers were in flight). Frees of blocks allocated while no window was
  open are not seen, because the reporter only knows sizes it saw allocated. So track one
  step you measure: what that step allocates and the next one frees is then known.

While a CPU window is open, the process's stderr (fd 2) goes to a temporary file, and on
closing every line but the profiler's own is written back: kineto prints a start and a stop
marker for every window and c10 a warning for the first free of a block it never saw allocated
(both straight to the file descriptor, not through Python), which a sweep's ranks would
otherwise print dozens of times into the user's console.
"""

from __future__ import annotations

import gc
import os
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch


@dataclass
class Peak:
    """What :func:`track_peak` measured; ``peak_bytes`` is final once the window has closed."""

    device: torch.device
    peak_bytes: int = 0  # max over the window of bytes allocated minus freed since its start
    net_bytes: int = 0  # allocated minus freed over the whole window


@contextmanager
def track_peak(device: torch.device | str = "cpu") -> Iterator[Peak]:
    """Measure the peak of allocated-minus-freed bytes on ``device`` inside the ``with`` block.
    On CPU, wait for the collectives issued inside the block before it ends (module docstring)."""
    device = torch.device(device)
    peak = Peak(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        entry = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        try:
            yield peak
        finally:
            torch.cuda.synchronize(device)
            peak.peak_bytes = max(0, torch.cuda.max_memory_allocated(device) - entry)
            peak.net_bytes = torch.cuda.memory_allocated(device) - entry
        return
    if device.type != "cpu":
        raise ValueError(f"track_peak measures cpu and cuda devices, not {device.type!r}")
    from torch.profiler import ProfilerActivity, profile

    prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
    with _without_profiler_chatter():
        prof.start()
        try:
            yield peak
        finally:
            prof.stop()
    peak.peak_bytes, peak.net_bytes = replay(_cpu_events(prof))


# What the profiler itself prints on every window (module docstring): kineto's markers, e.g.
# "USDT:2026-11-27 05:28:23 3800:3800 SyncActivityProfilerHandler.cpp:52] profiler_start",
# and c10's CPUAllocator.cpp warning about a block allocated before the window.
PROFILER_CHATTER = (b"SyncActivityProfilerHandler.cpp", b"GenericActivityProfiler.cpp",
                    b"Memory block of unknown size was allocated before the profiling started")


@contextmanager
def _without_profiler_chatter(fd: int = 2) -> Iterator[None]:
    """Hold ``fd`` in a temporary file inside the block; then write back all but PROFILER_CHATTER."""
    try:
        saved = os.dup(fd)
    except OSError:  # no such descriptor (a daemon): nothing to hold
        yield
        return
    held = tempfile.TemporaryFile()  # a file, not a pipe: a pipe would block a writer once full
    _flush()
    os.dup2(held.fileno(), fd)
    try:
        yield
    finally:
        _flush()
        os.dup2(saved, fd)
        os.close(saved)
        held.seek(0)
        kept = b"".join(line for line in held.read().splitlines(keepends=True)
                        if not any(mark in line for mark in PROFILER_CHATTER))
        held.close()
        while kept:
            kept = kept[os.write(fd, kept):]


def _flush() -> None:
    """Send what Python has buffered for stdout and stderr to their descriptors now."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (AttributeError, ValueError, OSError):  # closed or replaced by something without flush
            pass


def _cpu_events(prof) -> Iterator[tuple[int, int]]:
    for e in prof.profiler.kineto_results.events():
        if e.name() == "[memory]" and str(e.device_type()).endswith("CPU"):
            yield e.start_ns(), e.nbytes()


def replay(events) -> tuple[int, int]:
    """(peak, net) of a window's (time, signed bytes) allocation events: the running sum's highest
    point (0 if it never rises above the start) and its end."""
    total = peak = 0
    for _, nbytes in sorted(events):
        total += nbytes
        peak = max(peak, total)
    return peak, total


def live_bytes(device: torch.device | str = "cpu") -> int:
    """Bytes allocated on ``device`` now. CUDA: the allocator's count. CPU: the distinct storages
    of every tensor Python can reach (the garbage collector tracks tensors); storages held only by
    C++ (autograd's saved tensors while a graph is alive) are not counted, so call it between
    steps, where there are none."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device)
    seen: dict[int, int] = {}
    for obj in gc.get_objects():
        # type(), not isinstance: isinstance reads __class__, which warns on deprecated torch aliases
        if issubclass(type(obj), torch.Tensor) and obj.device.type == device.type and not obj.is_meta:
            try:
                storage = obj.untyped_storage()
                if storage.nbytes():
                    seen[storage.data_ptr()] = storage.nbytes()
            except (RuntimeError, NotImplementedError):
                # sparse layouts have no storage; a wrapper subclass (a DTensor) has none of its own
                # (its local tensor is counted where gc finds it)
                continue
    return sum(seen.values())
