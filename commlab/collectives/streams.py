"""CUDA communication streams and events, written so that the same calls are no-ops on CPU.

The stream design (docs/design.md, "Streams"): each communication channel (one process group's
worker) owns one CUDA stream per device. A collective is handed over with an event recorded on
the caller's (compute) stream; the comm stream waits on that event, not the host, so backward
keeps queueing kernels while the collective runs. Its future is completed on the comm stream, so
``future.wait()`` (torch.futures.Future with devices) makes the waiter's stream wait on it: the
gradient write-back is ordered after the collective without blocking the host. Timing stamps are
events recorded on the stream where the moment happens: ``launched`` / ``done`` on the comm
stream. On CPU the stream is None everywhere and stamps are ``perf_counter`` floats.

torch's ProcessGroupNCCL does the same for its own collectives (one internal stream per device
and group, torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp); this module gives commlab's Python
collectives, which run many small ops per collective, the same shape.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

import torch


def new_comm_stream(device: torch.device) -> Any:
    """A dedicated stream for one channel on ``device`` (None for a CPU device)."""
    if device.type != "cuda":
        return None
    return torch.cuda.Stream(device=device)


def record_ready(device: torch.device) -> Any:
    """An event on the caller's current stream of ``device``: "the inputs are produced" (None on CPU)."""
    if device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event


@contextlib.contextmanager
def on_stream(stream: Any, ready: Any = None) -> Iterator[Any]:
    """Make ``stream`` current (and wait on ``ready`` there) for the body; nothing on CPU."""
    if stream is None:
        yield None
        return
    with torch.cuda.device(stream.device), torch.cuda.stream(stream):
        if ready is not None:
            stream.wait_event(ready)
        yield stream


def stamp(stream: Any = None) -> Any:
    """A timing stamp: ``perf_counter`` on CPU, a timing event recorded on ``stream`` on CUDA."""
    if stream is None:
        return time.perf_counter()
    event = torch.cuda.Event(enable_timing=True)
    event.record(stream)
    return event


def keep_alive(tensor: torch.Tensor, stream: Any) -> None:
    """Tell the caching allocator ``tensor`` is used on ``stream`` (it was allocated on another)."""
    if stream is not None:
        tensor.record_stream(stream)


def join(stream: Any) -> None:
    """Make the caller's current stream wait for everything queued on ``stream`` (no host wait)."""
    if stream is not None:
        torch.cuda.current_stream(stream.device).wait_stream(stream)
