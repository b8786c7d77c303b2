"""Where a calibration rank computes and how it times: its device, its clock, its allocator's state.

Calibration's code is one path on every device; only what this module returns differs:

- the device: a rank's own GPU on NCCL (the current device, which commlab.launch and the
  launchers' rank entry set by commlab/runtime/devices.py's rule), the CPU on Gloo; the model,
  the batch and every buffer live there;
- the clock: ``time.perf_counter`` stamps on the CPU; CUDA events on a GPU, recorded on a stream
  and resolved (synchronized) afterwards, so that a time is what the GPU took, not the host's
  enqueueing (commlab/runtime/timer.py's two clocks, which DDP's own timings use too); the CUDA
  clock can also hold its stream with a spin kernel, which the collective tables queue their
  calls behind (commlab/costmodel/calibration/devicetime.py's collective_timer);
- the CUDA caching allocator's state after the measurements (peak and reserved bytes, retries):
  a calibration that measured with a cold or thrashing allocator says so in its entry.
"""

from __future__ import annotations

from typing import Any

import torch

import functools

from commlab.runtime.timer import CpuClock, CudaClock, make_clock, time_collective, time_queued, timed

Clock = CpuClock | CudaClock
__all__ = ["Clock", "allocator_state", "calibration_device", "clock_for", "timed", "to_device"]


def calibration_device(backend: str, current: int | None = None) -> torch.device:
    """The device a calibration rank measures on: on NCCL the current CUDA device (``current``
    overrides it, for tests without a GPU), on any other backend the CPU."""
    if backend != "nccl":
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device() if current is None else current)


def clock_for(device: torch.device) -> Clock:
    """CUDA events on a GPU, ``perf_counter`` on the CPU."""
    return make_clock(device)


def to_device(value: Any, device: torch.device) -> Any:
    """Tensors (also inside tuples and lists) moved to ``device``; anything else as it is."""
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, (tuple, list)):
        return type(value)(to_device(v, device) for v in value)
    return value


def allocator_state(device: torch.device) -> dict[str, int]:
    """The CUDA caching allocator's counters that bear on timings ({} on the CPU)."""
    if device.type != "cuda":
        return {}
    stats = torch.cuda.memory_stats(device)
    keys = {"allocated_peak_bytes": "allocated_bytes.all.peak", "reserved_bytes": "reserved_bytes.all.current",
            "alloc_retries": "num_alloc_retries", "ooms": "num_ooms"}
    return {name: int(stats.get(key, 0)) for name, key in keys.items()}


def collective_timer(device: torch.device, clock):
    """How a collective is timed on ``device``. On a GPU the host only enqueues it: timed alone
    from a barrier, an event on an idle stream would count the host's launch (small sizes came
    out slow) and, on an early rank, the wait for the last rank to leave the barrier; so batches
    are queued back to back behind a spin (commlab/runtime/timer.py's time_queued). On the CPU a
    call is the host's own work, with no queue to hide a launch behind: each call from a barrier,
    as always (the skew of Gloo's barrier exit stays inside; the held-out checks rest on it)."""
    if device.type == "cuda":
        return functools.partial(time_queued, hold=clock.hold)
    return time_collective
