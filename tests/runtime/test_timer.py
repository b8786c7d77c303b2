"""The one timing loop (commlab/runtime/timer.py): warm-up dropped, rounds in turn, hooks untimed.

Clocks here are counters the steps themselves advance, so every sample is known exactly.
"""

import pytest

from commlab.runtime import timer
from commlab.runtime.timer import (
    Counter,
    StartTime,
    alternate,
    rotate,
    time_collective,
    time_sizes,
    timed,
    timed_rounds,
    timed_steps,
)


class Ticks:
    """A clock the test advances: each step adds its own cost."""

    def __init__(self):
        self.now = 0.0

    def add(self, seconds):
        self.now += seconds


def test_orders_alternate_and_rotate():
    keys = ["a", "b", "c"]
    assert [alternate(r, keys) for r in range(3)] == [keys, ["c", "b", "a"], keys]
    assert [rotate(r, keys) for r in range(4)] == [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"], keys]
    assert rotate(5, []) == []


def test_rounds_drop_the_warmup_and_keep_each_step_s_own_samples():
    ticks, calls = Ticks(), []

    def step(name, cost):
        def run():
            calls.append(name)
            ticks.add(cost)
        return run

    steps = {"a": step("a", 1.0), "b": step("b", 10.0)}

    def grow(name):  # untimed: must not land in a sample
        ticks.add(1000.0)

    samples = timed_rounds(steps, iters=3, warmup=2, meters={"s": Counter(lambda: ticks.now)}, before=grow)
    assert calls == ["a", "b", "b", "a", "a", "b", "b", "a", "a", "b"]  # alternating rounds
    assert samples == {"s": {"a": [1.0, 1.0, 1.0], "b": [10.0, 10.0, 10.0]}}


def test_hooks_run_in_their_places():
    events = []
    samples = timed_rounds({"x": lambda: events.append("step")}, iters=2, warmup=1,
                           meters={"n": Counter(lambda: len(events))},
                           before=lambda k: events.append(f"before {k}"),
                           after=lambda k, timed_: events.append(f"after {timed_}"),
                           warmed=lambda: events.append("warmed"),
                           after_round=lambda r, s: events.append(f"round {r} {len(s['n']['x'])}"))
    assert events == ["before x", "step", "after False", "round 0 0", "warmed",
                      "before x", "step", "after True", "round 1 1",
                      "before x", "step", "after True", "round 2 2"]
    assert samples["n"]["x"] == [1, 1]  # only the step between the stamps


def test_warmed_runs_even_without_warmup_and_never_without_timed_rounds():
    seen = []
    timed_steps(lambda: None, iters=1, warmup=0, warmed=lambda: seen.append(1))
    timed_steps(lambda: None, iters=0, warmup=2, warmed=lambda: seen.append(2))
    assert seen == [1]


def test_timed_steps_returns_per_step_seconds_on_its_clock():
    ticks = Ticks()
    costs = iter([5.0, 1.0, 2.0, 3.0])
    got = timed_steps(lambda: ticks.add(next(costs)), iters=3, warmup=1, clock=Counter(lambda: ticks.now))
    assert got == [1.0, 2.0, 3.0]
    real = timed_steps(lambda: sum(range(1000)), iters=4)
    assert len(real) == 4 and all(s >= 0 for s in real)


def test_start_time_gives_each_call_s_start():
    starts = timed_steps(lambda: None, iters=3, warmup=1, clock=StartTime())
    assert len(starts) == 3 and starts == sorted(starts) and starts[0] > 0
    assert timed(Counter(iter([1.0, 4.5]).__next__), lambda: None) == 3.5


def test_a_collective_is_timed_from_a_barrier_after_one_untimed_call(monkeypatch):
    events = []
    monkeypatch.setattr(timer, "_barrier", lambda: events.append("barrier"))
    got = time_collective(lambda: events.append("call"), iters=2, clock=Counter(lambda: len(events)),
                          before=lambda: events.append("before"))
    assert events == ["before", "barrier", "call"] * 3
    assert got == [1, 1]

    events.clear()
    prepared = []

    def prepare(nbytes):
        prepared.append((nbytes, len(events)))  # buffers made before any of this size's calls
        return lambda: events.append(nbytes)

    table = time_sizes(prepare, [4, 64], iters=2, warmup=1, clock=Counter(lambda: len(events)))
    assert prepared == [(4, 0), (64, 6)]
    assert table == [[1, 1], [1, 1]]
    with pytest.raises(TypeError):
        time_sizes(prepare, [4], 1, 1, Counter(lambda: 0))  # the clock is keyword-only
