"""Per-iteration timings that DDP records: forward, backward compute, each bucket, exposed comm.

All times are seconds relative to the start of the iteration's forward (``t0``). On CPU stamps are
``time.perf_counter`` floats; on CUDA they are events recorded on the stream where the moment
happens, resolved after the iteration (never during backward). One definition per column, the
same on CPU and CUDA (the DDP paper's latency breakdown, Li et al. VLDB 2020, section 5):

Per bucket:
- ``ready``: its last gradient was copied into it (compute stream on CUDA);
- ``queued``: it was handed to its channel (the all-reduce call or the comm hook returned to the
  reducer's launch); ``launched - queued`` is the time it waited behind earlier collectives;
- ``launched``: its collective actually started on its channel: when the group's comm worker
  began running it (commlab's p2p algorithms), when the backend call was issued (``native``; the
  backend's own queue is not observable on Gloo), when the comm hook was called (a hook), on CUDA
  an event on the comm stream just before the collective. Not when it was queued;
- ``done``: the collective completed (on CUDA: an event on the comm stream after it).

Per iteration:
- ``forward``: forward start -> forward end;
- ``backward_compute``: forward end -> end of backward compute (the autograd engine has run the
  whole graph; on CPU the moment the end-of-backward callback starts);
- ``comm``: the first bucket launched -> the last bucket done (wall span of communication);
- ``exposed_comm``: end of backward compute -> the last bucket done, 0 if every bucket finished
  before backward did: the communication backward did not hide;
- ``unused_allreduce``: the all-reduce of "used locally" flags (``find_unused_parameters``), from
  its issue (once the group's queue has drained) to the flags on the host; 0 without it;
- ``write_back``: copying the reduced buckets into ``.grad`` (waiting for a bucket not included);
- ``total``: forward start -> gradients synchronised and written back (end of backward).

Memory is bounded: a reducer keeps the last :data:`MAX_ITERATIONS` iterations.
"""

from __future__ import annotations

from collections import deque
from dataclasses import asdict, dataclass, field, fields
from typing import Any

# The clocks are the runtime's (one definition for every timing; commlab/runtime/timer.py).
from commlab.runtime.timer import CpuClock, CudaClock

MAX_ITERATIONS = 10_000  # iterations kept; older ones are dropped (deque maxlen)


@dataclass
class BucketTiming:
    index: int  # position in reduction order
    nbytes: int
    num_params: int
    ready: float  # its last gradient arrived
    launched: float  # its collective started on its channel
    done: float  # its collective completed
    queued: float = float("nan")  # it was handed to its channel (<= launched)


@dataclass
class IterationTiming:
    forward: float
    backward_compute: float
    comm: float
    exposed_comm: float
    total: float
    buckets: list[BucketTiming] = field(default_factory=list)
    write_back: float = 0.0
    unused_allreduce: float = 0.0

    def as_row(self) -> dict[str, float]:
        """The scalar columns (:data:`COLUMNS`), for a tidy table (per-bucket rows come from ``buckets``)."""
        row = asdict(self)
        row.pop("buckets")
        return row


# The per-iteration columns, in order: what the sweep stores (commlab/runs/store.py) and what
# the predictor writes in its place (commlab/costmodel/lowering/ddp.py), from this one definition.
# This module imports no torch, so that reading results does not either.
COLUMNS = [f.name for f in fields(IterationTiming) if f.name != "buckets"]


@dataclass
class RawIteration:
    """One synchronised iteration's stamps, before they are turned into seconds."""

    start: Any
    forward_end: Any
    end: Any
    # (nbytes, num_params, ready, launched, done[, queued]) per bucket in reduction order
    buckets: list[tuple]
    backward_end: Any = None  # end of backward compute; None: the last bucket's ready
    # (start, end) stamps of the unused-parameter all-reduce (None without one) and of each
    # bucket's write-back
    unused: tuple[Any, Any] | None = None
    write_back: list[tuple[Any, Any]] = field(default_factory=list)


def resolve(clock: CpuClock | CudaClock, raw: RawIteration) -> IterationTiming:
    """Turn stamps into the breakdown defined in this module's docstring."""
    s = clock.seconds
    t0 = raw.start
    buckets = [
        BucketTiming(i, b[0], b[1], s(t0, b[2]), s(t0, b[3]), s(t0, b[4]), s(t0, b[5]) if len(b) > 5 else float("nan"))
        for i, b in enumerate(raw.buckets)
    ]
    forward = s(t0, raw.forward_end)
    total = s(t0, raw.end)
    last_ready = max((b.ready for b in buckets), default=forward)
    backward_end = last_ready if raw.backward_end is None else s(t0, raw.backward_end)
    first_launch = min((b.launched for b in buckets), default=backward_end)
    last_done = max((b.done for b in buckets), default=backward_end)

    def span(pair: tuple[Any, Any] | None) -> float:
        return 0.0 if pair is None else s(t0, pair[1]) - s(t0, pair[0])

    return IterationTiming(
        forward=forward,
        backward_compute=backward_end - forward,
        comm=last_done - first_launch,
        exposed_comm=max(0.0, last_done - backward_end),
        total=total,
        buckets=buckets,
        write_back=sum(span(pair) for pair in raw.write_back),
        unused_allreduce=span(raw.unused),
    )


class TimingLog:
    """The last ``maxlen`` iterations: stamps as recorded, resolved into seconds only when read
    (on CUDA resolving waits for the events, which must not happen during backward)."""

    def __init__(self, clock: CpuClock | CudaClock, maxlen: int):
        self.clock = clock
        self._raw: deque[RawIteration] = deque(maxlen=maxlen)
        self._resolved: deque[IterationTiming] = deque(maxlen=maxlen)

    def append(self, raw: RawIteration) -> None:
        self._raw.append(raw)

    def resolved(self) -> list[IterationTiming]:
        while self._raw:
            self._resolved.append(resolve(self.clock, self._raw.popleft()))
        return list(self._resolved)

    def clear(self) -> None:
        self._raw.clear()
        self._resolved.clear()
