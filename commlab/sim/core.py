"""The discrete-event core every prediction runs on: tasks with durations on resources.

A *resource* is anything that does one thing at a time in a fixed order: one rank's compute
stream, one communication channel (a process group's queue). A *task* occupies one resource for
its duration once its dependencies have finished. Tasks on one resource run in the order they are
given, like kernels on a CUDA stream or collectives on a process group, so the model needs no
scheduling policy of its own: the order is part of the input, as in a pipeline schedule or the
DDP bucket order. (FlexFlow's simulator and dPRO's replayer work on the same kind of task graph.)

Resources on one *host* (one rank's CPU cores, say) can slow each other down: while tasks run
concurrently, each advances at ``rate(task, others)`` of its nominal speed. Progress is integrated
exactly between events (a fluid model), so a backward overlapped with an all-reduce stretches by
exactly the slowdown for exactly the overlapped time. Costs and rates are the caller's: they come
from calibration, never from here.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

RateFn = Callable[["Task", Sequence["Task"]], float]

_EPS = 1e-12


class DeadlockError(ValueError):
    """No task can start: every waiting resource's next task depends on one that cannot run."""


@dataclass(frozen=True)
class Task:
    name: str
    resource: str
    duration: float  # seconds at full speed
    deps: tuple[str, ...] = ()
    kind: str = ""  # a free label: "forward", "allreduce", "send", ...
    host: str | None = None  # tasks of one host may interfere; None = the resource alone
    release: float = 0.0  # earliest start
    meta: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)

    @property
    def where(self) -> str:
        return self.resource if self.host is None else self.host


@dataclass(frozen=True)
class Span:
    name: str
    resource: str
    kind: str
    host: str | None
    start: float
    end: float
    meta: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)

    @property
    def length(self) -> float:
        return self.end - self.start


@dataclass
class SimResult:
    spans: dict[str, Span]
    order: dict[str, list[str]]  # resource -> task names in execution order

    @property
    def makespan(self) -> float:
        return max((s.end for s in self.spans.values()), default=0.0)

    def by_resource(self, resource: str) -> list[Span]:
        return [self.spans[name] for name in self.order.get(resource, [])]

    def busy(self, resource: str) -> float:
        return sum(s.length for s in self.by_resource(resource))


def _check(tasks: list[Task]) -> None:
    names = set()
    for t in tasks:
        if t.name in names:
            raise ValueError(f"task name {t.name!r} given twice")
        if not (t.duration >= 0 and math.isfinite(t.duration)):
            raise ValueError(f"task {t.name!r}: duration must be finite and >= 0, got {t.duration}")
        names.add(t.name)
    for t in tasks:
        missing = [d for d in t.deps if d not in names]
        if missing:
            raise ValueError(f"task {t.name!r} depends on unknown task(s) {missing}")


def simulate(tasks: Iterable[Task], rate: RateFn | None = None) -> SimResult:
    """Run ``tasks`` to completion; tasks of a resource run in the order given.

    ``rate(task, others)`` is the speed (0, 1] of ``task`` while ``others`` (the other running
    tasks of its host) run; default 1. Raises DeadlockError if the tasks cannot all finish.
    """
    tasks = list(tasks)
    _check(tasks)
    queues: dict[str, list[Task]] = {}
    for t in tasks:
        queues.setdefault(t.resource, []).append(t)
    head = {r: 0 for r in queues}  # index of each resource's next task
    ended: dict[str, float] = {}
    started: dict[str, float] = {}
    running: dict[str, tuple[Task, float]] = {}  # resource -> (task, remaining work)
    spans: dict[str, Span] = {}
    now = 0.0

    def startable(t: Task) -> bool:
        return all(d in ended for d in t.deps)

    while len(ended) < len(tasks):
        # Start every idle resource whose next task is ready at `now`.
        next_release = math.inf
        for r, q in queues.items():
            if r in running or head[r] == len(q):
                continue
            t = q[head[r]]
            if not startable(t):
                continue
            if t.release > now + _EPS:
                next_release = min(next_release, t.release)
                continue
            running[r] = (t, t.duration)
            started[t.name] = now
        if not running:
            if math.isfinite(next_release):
                now = next_release
                continue
            stuck = {r: q[head[r]].name for r, q in queues.items() if head[r] < len(q)}
            raise DeadlockError(f"no task can start at t={now:.6g}s; waiting heads: {stuck}")
        speeds = _speeds([t for t, _ in running.values()], rate)
        # Advance to the first completion (or release that may start a task).
        dt = min(rem / speeds[t.name] for t, rem in running.values())
        dt = min(dt, next_release - now)
        now += dt
        for r, (t, rem) in list(running.items()):
            rem -= speeds[t.name] * dt
            if rem <= _EPS * max(1.0, t.duration):
                del running[r]
                head[r] += 1
                ended[t.name] = now
                spans[t.name] = Span(t.name, t.resource, t.kind, t.host, started[t.name], now, t.meta)
            else:
                running[r] = (t, rem)
    order = {r: [t.name for t in q] for r, q in queues.items()}
    return SimResult(spans=spans, order=order)


def _speeds(active: list[Task], rate: RateFn | None) -> dict[str, float]:
    if rate is None:
        return {t.name: 1.0 for t in active}
    speeds = {}
    for t in active:
        others = [o for o in active if o is not t and o.where == t.where]
        s = rate(t, others) if others else 1.0
        if not 0 < s <= 1:
            raise ValueError(f"rate for task {t.name!r} must be in (0, 1], got {s}")
        speeds[t.name] = s
    return speeds
