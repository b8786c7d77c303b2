"""How the GPU calibration times a collective, on a fake host and device (pure, no GPU).

A fake rank stands for one of two ranks running the same program: every kernel launch costs the
host ``L`` seconds, a collective lasts ``T`` on the devices once both ranks' devices reach it,
and after each barrier the second rank's host is ``S`` seconds behind the first's (barrier-exit
skew). The old timing (an event on an idle stream right after a barrier, one collective, an
event; the slowest rank's median) reports T + L + S; the queued timing reports T.
The real timing on a GPU: tests/test_gpu.py (scripts/gpu_check.py).
"""

import functools

import pytest
import torch

from commlab.costmodel.calibration.devicetime import collective_timer
from commlab.runtime import timer
from commlab.runtime.timer import CudaClock, time_collective, time_queued

T, L, S = 100e-6, 20e-6, 300e-6


class FakeRank:
    """Rank ``me``; rank q's host runs ``starts[q]`` seconds after a common base, which a barrier
    moves to the last rank's arrival (its exit skew stays). The device runs its queue in order:
    a kernel starts once the host has launched it and the work before it is done; a collective
    starts when that holds on every rank; an event is stamped when this rank's device reaches it."""

    def __init__(self, me: int, starts: list[float], launch: float = L, collective: float = T):
        self.me, self.starts, self.launch, self.collective = me, starts, launch, collective
        self.base = 0.0
        self.free = [0.0] * len(starts)  # when each rank's device has run everything queued
        self.barriers = 0

    def host(self) -> float:
        return self.base + self.starts[self.me]

    def barrier(self) -> None:
        self.base += max(self.starts)
        self.barriers += 1

    def _launch(self) -> list[float]:
        """Each rank's host time when this launch is in its queue (every rank launches alike)."""
        self.base += self.launch
        return [self.base + s for s in self.starts]

    def all_reduce(self) -> None:
        queued = self._launch()
        begin = max(max(free, at) for free, at in zip(self.free, queued))
        self.free = [begin + self.collective] * len(self.free)

    def hold(self, seconds: float) -> None:
        self.free = [max(free, at) + seconds for free, at in zip(self.free, self._launch())]

    # the clock: CUDA events on this rank's stream
    def stamp(self) -> float:
        return max(self.free[self.me], self.host())

    def seconds(self, start: float, end: float) -> float:
        self.base = max(self.base, end - self.starts[self.me])  # the host waits for the event
        return end - start


def _per_rank(method, starts, monkeypatch, **fake) -> list[float]:
    """Each rank's median sample under ``method(fake)``."""
    medians = []
    for me in range(len(starts)):
        rank = FakeRank(me, starts, **fake)
        monkeypatch.setattr(timer, "_barrier", rank.barrier)
        samples = method(rank)
        medians.append(sorted(samples)[len(samples) // 2])
    return medians


def _old(rank: FakeRank) -> list[float]:
    return time_collective(rank.all_reduce, 5, clock=rank)


def _queued(rank: FakeRank, hold: bool = True) -> list[float]:
    return time_queued(rank.all_reduce, 5, clock=rank, hold=rank.hold if hold else None, host=rank.host)


def test_the_old_timing_counts_the_launch_and_the_barrier_exit_skew(monkeypatch):
    assert _per_rank(_old, [0.0], monkeypatch) == pytest.approx([T + L])  # one rank: the launch inside
    early, late = _per_rank(_old, [0.0, S], monkeypatch)
    assert early == pytest.approx(T + L + S)  # it waited in the collective for the late rank
    assert late == pytest.approx(T + L)
    assert max(early, late) == pytest.approx(T + L + S)  # what calibration's slowest-rank rule kept


def test_queued_timing_reports_the_collective_alone_on_every_rank(monkeypatch):
    assert _per_rank(_queued, [0.0], monkeypatch) == pytest.approx([T])
    assert _per_rank(_queued, [0.0, S], monkeypatch) == pytest.approx([T, T])
    assert _per_rank(_queued, [S, 0.0, S / 3], monkeypatch) == pytest.approx([T] * 3)


def test_the_hold_hides_launches_longer_than_the_collective(monkeypatch):
    slow_launch = dict(launch=5 * T, collective=T)
    no_hold = functools.partial(_queued, hold=False)
    # back to back alone: the device waits for each launch, the skew is still out
    assert _per_rank(no_hold, [0.0, S], monkeypatch, **slow_launch) == pytest.approx([5 * T, 5 * T])
    assert _per_rank(_queued, [0.0, S], monkeypatch, **slow_launch) == pytest.approx([T, T])
    # where a collective outlasts its launch, back to back is enough
    assert _per_rank(no_hold, [0.0, S], monkeypatch) == pytest.approx([T, T])


def test_queued_rounds_barriers_and_the_hold_sized_on_warm_up(monkeypatch):
    rank = FakeRank(0, [0.0])
    monkeypatch.setattr(timer, "_barrier", rank.barrier)
    held, before = [], []
    samples = time_queued(rank.all_reduce, 3, warmup=2, clock=rank, batch=4, host=rank.host,
                          hold=lambda s: (held.append(s), rank.hold(s)), before=lambda: before.append(1))
    assert len(samples) == 3 and rank.barriers == 5 and len(before) == 5
    assert held == pytest.approx([2 * 5 * L] * 4)  # no hold before the first round is measured
    with pytest.raises(ValueError, match="warmup"):
        time_queued(rank.all_reduce, 1, warmup=0, clock=rank, hold=rank.hold)


def test_calibration_queues_on_a_gpu_and_keeps_the_cpu_timing():
    assert collective_timer(torch.device("cpu"), timer.CpuClock()) is time_collective
    clock = CudaClock()  # choosing it needs no GPU
    chosen = collective_timer(torch.device("cuda", 0), clock)
    assert chosen.func is time_queued and chosen.keywords == {"hold": clock.hold}
