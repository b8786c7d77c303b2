"""Per-iteration timings that DDP records: forward, backward compute, each bucket, exposed comm.

All times are seconds relative to the start of the iteration's forward (``t0``). On CPU they come
from ``time.perf_counter``; on CUDA from events, resolved after the iteration.

Definitions (the DDP paper's latency breakdown, Li et al. VLDB 2020, section 5):
- ``forward``: forward start -> forward end;
- ``backward_compute``: forward end -> the last gradient becomes ready;
- ``comm``: the first bucket launched -> the last bucket done (wall span of communication);
- ``exposed_comm``: the last gradient ready -> all buckets done and written back, i.e. the part of
  communication that backward did not hide;
- ``total``: forward start -> gradients synchronised (end of backward).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any

import torch


@dataclass
class BucketTiming:
    index: int  # position in reduction order
    nbytes: int
    num_params: int
    ready: float  # its last gradient arrived
    launched: float  # its all-reduce was started
    done: float  # its all-reduce completed


@dataclass
class IterationTiming:
    forward: float
    backward_compute: float
    comm: float
    exposed_comm: float
    total: float
    buckets: list[BucketTiming] = field(default_factory=list)

    def as_row(self) -> dict[str, float]:
        """The scalar columns, for a tidy table (per-bucket rows come from ``buckets``)."""
        row = asdict(self)
        row.pop("buckets")
        return row


class CpuClock:
    """Stamps are ``time.perf_counter()`` floats; cheap enough to take inside autograd hooks."""

    def stamp(self) -> float:
        return time.perf_counter()

    def seconds(self, start: float, stamp: float) -> float:
        return stamp - start


class CudaClock:
    """Stamps are CUDA events recorded on the current stream, resolved once the iteration is over.

    An event marks when the GPU reaches that point of the stream, which is what the breakdown needs
    (the host thread runs ahead of the device); resolving waits for the events, so it is deferred.
    """

    def stamp(self) -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def seconds(self, start: torch.cuda.Event, stamp: torch.cuda.Event) -> float:
        stamp.synchronize()
        return start.elapsed_time(stamp) / 1000.0


def make_clock(device: torch.device) -> CpuClock | CudaClock:
    return CudaClock() if device.type == "cuda" else CpuClock()


@dataclass
class RawIteration:
    """One synchronised iteration's stamps, before they are turned into seconds."""

    start: Any
    forward_end: Any
    end: Any
    # (nbytes, num_params, ready, launched, done) per bucket in reduction order
    buckets: list[tuple[int, int, Any, Any, Any]]


def resolve(clock: CpuClock | CudaClock, raw: RawIteration) -> IterationTiming:
    """Turn stamps into the breakdown defined in this module's docstring."""
    s = clock.seconds
    t0 = raw.start
    buckets = [
        BucketTiming(i, nbytes, n, s(t0, ready), s(t0, launched), s(t0, done))
        for i, (nbytes, n, ready, launched, done) in enumerate(raw.buckets)
    ]
    forward = s(t0, raw.forward_end)
    total = s(t0, raw.end)
    last_ready = max((b.ready for b in buckets), default=forward)
    first_launch = min((b.launched for b in buckets), default=last_ready)
    last_done = max((b.done for b in buckets), default=last_ready)
    return IterationTiming(
        forward=forward,
        backward_compute=last_ready - forward,
        comm=last_done - first_launch,
        exposed_comm=total - last_ready,
        total=total,
        buckets=buckets,
    )
