"""Timing repeated work: clocks, and the one loop of warm-up then timed calls that every measurement runs.

A clock has ``stamp()`` and ``seconds(start, end)``; what it counts is the measurement:

- :class:`CpuClock`: ``perf_counter`` stamps, cheap enough inside autograd hooks;
- :class:`CudaClock`: CUDA events recorded on a stream and resolved afterwards, so that a time is
  what the GPU took, not the host's enqueueing (DDP's own timings and calibration on NCCL);
- :class:`WallClock`: host wall time with the device's queued work included (it synchronises a
  GPU before each stamp): what a step costs the training loop;
- :class:`Counter`: any monotone reading (process CPU time, page faults, cudaMalloc calls);
- :class:`StartTime`: the stamp a call started at (to line timelines of several ranks up).

:func:`timed_rounds` is the loop: ``warmup`` untimed rounds, then ``iters`` timed ones; a round
runs every step once, in an order that changes from round to round (:func:`alternate`,
:func:`rotate`) so that a load change on a shared machine hits every step alike and none always
goes first; ``before`` runs untimed ahead of each call (a barrier, zeroing gradients). Its
special cases: :func:`timed_steps` (one step), :func:`time_collective` (one collective, each call
from a barrier, after one untimed call that allocates and connects) and :func:`time_sizes` (a
collective's samples at every size). :func:`time_queued` times a collective that the host only
enqueues (on a GPU): batches queued back to back, as nccl-tests times them.

Torch is imported only by the clocks that need it, so this module is free to import anywhere.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any, Protocol, TypeVar

K = TypeVar("K", bound=Hashable)


class Clock(Protocol):
    def stamp(self) -> Any: ...

    def seconds(self, start: Any, end: Any) -> float: ...


class CpuClock:
    """Stamps are ``time.perf_counter()`` floats; cheap enough to take inside autograd hooks."""

    def stamp(self, stream: Any = None) -> float:
        return time.perf_counter()

    def seconds(self, start: float, stamp: float) -> float:
        return stamp - start


class CudaClock:
    """Stamps are CUDA events recorded on a stream, resolved once the iteration is over.

    An event marks when the GPU reaches that point of the stream, which is what the breakdown needs
    (the host thread runs ahead of the device); resolving waits for the events, so it is deferred.
    ``stamp(stream)`` records on ``stream`` (a comm stream for launched/done), else on the current
    (compute) stream.
    """

    def stamp(self, stream: Any = None) -> Any:
        import torch

        event = torch.cuda.Event(enable_timing=True)
        event.record(stream)
        return event

    def seconds(self, start: Any, stamp: Any) -> float:
        stamp.synchronize()
        return start.elapsed_time(stamp) / 1000.0

    def hold(self, seconds: float) -> None:
        """Keep the current stream busy for about ``seconds`` (a spin kernel), so that what the
        host enqueues meanwhile waits in the queue and then runs back to back."""
        import torch

        device = torch.cuda.current_device()
        if device not in _SPIN_RATE:
            _SPIN_RATE[device] = _spin_rate()
        torch.cuda._sleep(max(int(seconds * _SPIN_RATE[device]), 1))


_SPIN_RATE: dict[int, float] = {}  # CUDA device -> the spin kernel's cycles per second


def _spin_rate(cycles: int = 20_000_000) -> float:
    """Cycles per second of ``torch.cuda._sleep`` on the current device: a spin of ``cycles``
    (about 10 ms at GPU clocks, so its own launch is negligible) timed by events, after an
    untimed one that loads the kernel and lets an idle GPU raise its clock (the spin counts
    cycles, so a rate taken at a lower clock would make later holds short)."""
    import torch

    torch.cuda._sleep(cycles)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    end.synchronize()
    return cycles / (start.elapsed_time(end) / 1000.0)


def make_clock(device: Any) -> CpuClock | CudaClock:
    """CUDA events on a GPU, ``perf_counter`` on the CPU."""
    return CudaClock() if device.type == "cuda" else CpuClock()


class WallClock(CpuClock):
    """``perf_counter`` stamps taken after the device's queued work is done (on a GPU,
    ``torch.cuda.synchronize``; nothing on the CPU)."""

    def __init__(self, device: Any = None):
        self.device = device if device is not None and device.type == "cuda" else None

    def stamp(self, stream: Any = None) -> float:
        if self.device is not None:
            import torch

            torch.cuda.synchronize(self.device)
        return time.perf_counter()


class Counter:
    """A monotone reading as a clock: a sample is how much it advanced (CPU seconds, faults)."""

    def __init__(self, read: Callable[[], float]):
        self.read = read

    def stamp(self) -> float:
        return self.read()

    def seconds(self, start: float, end: float) -> float:
        return end - start


class StartTime(WallClock):
    """A sample is the ``perf_counter`` stamp the call started at, as :class:`WallClock` takes it
    (one clock for all local ranks: to line their timelines up)."""

    def seconds(self, start: float, stamp: float) -> float:
        return start


def timed(clock: Clock, fn: Callable[[], Any]) -> float:
    """Seconds ``fn`` takes on ``clock``'s device (on a GPU: from its first kernel to its last)."""
    start = clock.stamp()
    fn()
    return clock.seconds(start, clock.stamp())


def alternate(round_: int, keys: Sequence[K]) -> list[K]:
    """Even rounds in order, odd rounds in reverse (pure)."""
    return list(keys) if round_ % 2 == 0 else list(keys)[::-1]


def rotate(round_: int, keys: Sequence[K]) -> list[K]:
    """Round r starts at key r (modulo their number) and wraps around (pure)."""
    shift = round_ % len(keys) if keys else 0
    return list(keys)[shift:] + list(keys)[:shift]


def timed_rounds(steps: Mapping[K, Callable[[], Any]], iters: int, warmup: int = 0, *,
                 meters: Mapping[str, Clock] | None = None, before: Callable[[K], Any] | None = None,
                 after: Callable[[K, bool], Any] | None = None, warmed: Callable[[], Any] | None = None,
                 after_round: Callable[[int, dict], Any] | None = None,
                 order: Callable[[int, Sequence[K]], Sequence[K]] = alternate) -> dict[str, dict[K, list[float]]]:
    """Run ``warmup + iters`` rounds of ``steps``, each round every step once in ``order(round,
    keys)``; returns, per meter (default ``{"seconds": CpuClock()}``) and step, the samples of the
    ``iters`` timed rounds. Untimed: ``before(key)`` ahead of each call, ``after(key, timed)``
    after it, ``warmed()`` once before the first timed round (to forget what warm-up recorded),
    ``after_round(round, samples)`` after each round (samples so far: to save them as it goes)."""
    meters = {"seconds": CpuClock()} if meters is None else meters
    keys = list(steps)
    samples: dict[str, dict[K, list[float]]] = {m: {k: [] for k in keys} for m in meters}
    for r in range(warmup + iters):
        if r == warmup and warmed is not None:
            warmed()
        for key in order(r, keys):
            if before is not None:
                before(key)
            starts = [clock.stamp() for clock in meters.values()]
            steps[key]()
            ends = [clock.stamp() for clock in meters.values()]
            if r >= warmup:
                for (name, clock), start, end in zip(meters.items(), starts, ends):
                    samples[name][key].append(clock.seconds(start, end))
            if after is not None:
                after(key, r >= warmup)
        if after_round is not None:
            after_round(r, samples)
    return samples


def timed_steps(step: Callable[[], Any], iters: int, warmup: int = 0, *, clock: Clock | None = None,
                before: Callable[[], Any] | None = None, after: Callable[[bool], Any] | None = None,
                warmed: Callable[[], Any] | None = None) -> list[float]:
    """Seconds on ``clock`` (default ``perf_counter``) of each of ``iters`` calls of ``step``
    after ``warmup`` untimed ones; ``before``, ``after`` and ``warmed`` as :func:`timed_rounds`'s."""
    return timed_rounds({0: step}, iters, warmup, meters={"seconds": clock or CpuClock()},
                        before=None if before is None else (lambda _k: before()),
                        after=None if after is None else (lambda _k, timed_: after(timed_)),
                        warmed=warmed)["seconds"][0]


def _barrier() -> None:
    import torch.distributed as dist

    dist.barrier()


def time_collective(call: Callable[[], Any], iters: int, warmup: int = 1, *, clock: Clock | None = None,
                    before: Callable[[], Any] | None = None) -> list[float]:
    """Seconds of each of ``iters`` calls of a collective (``call``, its buffers made already),
    each from a barrier of the default group (after ``before()``) so that every rank starts it
    together, after ``warmup`` untimed calls (the first allocates and connects)."""
    ahead = _barrier if before is None else (lambda: (before(), _barrier()))
    return timed_steps(call, iters, warmup, clock=clock, before=ahead)


def time_queued(call: Callable[[], Any], iters: int, warmup: int = 1, *, clock: Clock, batch: int = 8,
                hold: Callable[[float], Any] | None = None, host: Callable[[], float] = time.perf_counter,
                before: Callable[[], Any] | None = None) -> list[float]:
    """Seconds per call of a collective that the host only enqueues (on a GPU), one sample per
    round for ``iters`` rounds after ``warmup`` untimed ones (at least one with ``hold``).

    A round, from a barrier of the default group (after ``before()``):

    1. ``hold(s)``: the device kept busy for twice the host time the last round's calls took to
       enqueue, so that every call below waits in the queue: no launch latency between them,
       however small the message (without ``hold`` the calls only run back to back where each
       lasts longer than its launch);
    2. one untimed call: a collective whose result needs every rank's input (all-reduce,
       reduce-scatter, all-gather) ends on each rank only once the last rank has reached it, so
       each rank's start below comes after the barrier-exit skew;
    3. the rank's own start stamp, ``batch`` calls, its end stamp: a sample is the span / ``batch``.

    nccl-tests (src/common.cu, BenchTime) times its calls back to back from its barrier to the
    stream's completion on a host clock and divides by their number, so the first launch and the
    skew are spread over the calls; it then averages over ranks by default (its -a option: mean,
    min, max or rank 0). 1 and 2 take them out instead. Each rank's sample is then free of skew,
    and so is any combination over ranks (calibration keeps the slowest rank's median, as a
    collective ends for all when the last rank is through)."""
    if hold is not None and warmup < 1:
        raise ValueError("time_queued sizes its hold on a warm-up round: warmup must be >= 1")
    samples: list[float] = []
    enqueue_s: float | None = None
    for r in range(warmup + iters):
        if before is not None:
            before()
        _barrier()
        if hold is not None and enqueue_s is not None:
            hold(2.0 * enqueue_s)
        launches = []
        t = host()
        call()
        launches.append(host() - t)
        start = clock.stamp()
        for _ in range(batch):
            t = host()
            call()
            launches.append(host() - t)
        end = clock.stamp()
        # the median launch: the round's first call may connect or allocate (seconds), once
        enqueue_s = sorted(launches)[len(launches) // 2] * len(launches)
        seconds = clock.seconds(start, end) / batch  # waits for the round: the next starts on an idle queue
        if r >= warmup:
            samples.append(seconds)
    return samples


def time_sizes(prepare: Callable[[int], Callable[[], Any]], sizes: Sequence[int], iters: int, warmup: int = 1, *,
               clock: Clock | None = None, each: Callable[..., list[float]] = time_collective) -> list[list[float]]:
    """``each``'s samples (:func:`time_collective`'s, or :func:`time_queued`'s) at every size of
    ``sizes`` (bytes): ``prepare(nbytes)`` makes that size's buffers, untimed, and returns the
    call to time."""
    return [each(prepare(nbytes), iters, warmup, clock=clock) for nbytes in sizes]
