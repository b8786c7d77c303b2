"""How far a prediction can be trusted: the model's measured error and the calibration's steadiness.

Two sources of doubt, kept apart:

- the model's own error, measured on held-out workloads (:data:`VALIDATION`, with where the
  figures come from). A predicted step time is given with the interval that error spans; two
  configurations whose predicted difference is below the worst *shape* error (the error left
  once one common factor per workload is taken out) are within noise of each other;
- the calibration's: its micro-benchmarks are repeated, and their medians' spread together with the
  machine's load average before and after say whether the machine was steady while it measured
  (other jobs on a CPU machine move single timings by tens of percent: docs/measurements.md).
  :func:`judge` is the decision, pure, on given spreads and loads.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class ValidationError:
    """Errors measured on work the model was not developed on (relative: predicted / measured - 1)."""

    abs_worst: float  # worst absolute error over the steady held-out configurations
    shape_worst: float  # worst shape error (one common factor per workload taken out)
    source: str


# docs/measurements.md, "2026-11-26 03:09-03:55 UTC": `commlab validate ddp --part
# mlp --part convnet` (absolute worst 18.1%, shape 9.7%) and `--part blocks` (13.4%, 9.4%),
# Gloo, world size 2, overlap on and off; `--part oversubscribed`: world sizes 3-4 up to 37.4%.
VALIDATION = ValidationError(
    abs_worst=0.181, shape_worst=0.097,
    source="held-out validation of 2026-11-26 (docs/measurements.md): Gloo, world size 2, three workloads, "
           "worst absolute error 18.1%, worst shape error 9.7%; world sizes 3-4 (more ranks than cores) "
           "missed by up to 37%")

# Thresholds of an unsteady calibration. Spread: how uncertain the micro-benchmarks' medians
# are (:func:`overall_spread`); quiet calibrations of this 2-core machine gave 3-22% (once 38%),
# so 25% is beyond its own noise (docs/measurements.md, 2026-11-26). Load: other jobs' runnable threads per core; above one half, a rank
# shares its core with another job for a good part of the time.
SPREAD_LIMIT = 0.25
LOAD_PER_CORE_LIMIT = 0.5
WIDEST = 0.75  # an interval's half-width is capped here (a wider one says nothing)


@dataclass(frozen=True)
class Steadiness:
    """Whether a calibration can be trusted, and the figures that say so."""

    steady: bool
    spread: float  # how uncertain the micro-benchmarks' medians are (:func:`overall_spread`)
    load_before: float
    load_after: float
    others_load: float  # the load average other jobs are taken to have caused
    cpus: int
    reasons: tuple[str, ...] = ()

    def as_json(self) -> dict:
        return {**asdict(self), "reasons": list(self.reasons)}

    @classmethod
    def from_json(cls, data: dict) -> Steadiness:
        return cls(**{**data, "reasons": tuple(data.get("reasons", ()))})

    def describe(self) -> str:
        load = f"load average {self.load_before:.1f} before and {self.load_after:.1f} after on {self.cpus} core(s)"
        if self.steady:
            return f"steady (micro-benchmark medians within {self.spread * 100:.0f}%, {load})"
        return f"UNSTEADY: {'; '.join(self.reasons)} ({load})"


JITTER_S = 50e-6  # a scheduler wake-up on loopback Gloo: timings closer than this are not told apart


def relative_spread(samples: Sequence[float], jitter_s: float = JITTER_S) -> float:
    """The spread of one repeated measurement (seconds) relative to its median; 0 for fewer than two.

    From four samples on it is the interquartile range: a preemption or two is the machine's
    doing, not the measurement's, and a full range grows with the number of samples; below
    four, max - min. The jitter is taken off first, so that a sub-millisecond collective's
    wake-up noise does not condemn a calibration whose every term is that small."""
    if len(samples) < 2:
        return 0.0
    mid = statistics.median(samples)
    if len(samples) >= 4:
        low, _, high = statistics.quantiles(samples, n=4)
    else:
        low, high = min(samples), max(samples)
    return max(0.0, high - low - jitter_s) / mid if mid > 0 else 0.0


def overall_spread(series: Iterable[Sequence[float]]) -> float:
    """How uncertain the calibrated medians are: each series' relative spread over the square
    root of its samples (a median of n samples wanders as 1/sqrt(n) of their spread), then the
    median over series, so one noisy micro-benchmark does not condemn a calibration. On this
    2-core machine single all-reduces after a barrier spread by 30-100% even when quiet, while
    their medians predicted held-out steps within 6% (docs/measurements.md)."""
    spreads = [relative_spread(s) / math.sqrt(len(s)) for s in series if len(s) > 1]
    return float(statistics.median(spreads)) if spreads else 0.0


def own_load(threads: int, seconds: float) -> float:
    """What ``threads`` busy threads add to the 1-minute load average over ``seconds``: the kernel's
    average decays with a 60 s time constant (kernel/sched/loadavg.c), so N (1 - exp(-T / 60))."""
    return threads * (1.0 - math.exp(-max(seconds, 0.0) / 60.0))


def others_load(load_before: float, load_after: float, *, own_threads: int, seconds: float,
                running_before: float | None = None) -> float:
    """The load other jobs put on the machine around a calibration of ``seconds``.

    The 1-minute load average lags: right after another run it is still high though nothing runs.
    ``running_before``, the runnable threads counted just before (other than the caller), splits
    ``load_before`` into what still runs and a past that only decays (by exp(-T / 60) over T):
    after the calibration, ``load_after`` less the calibration's own threads and that decayed past
    is what others ran meanwhile. Without ``running_before`` all of ``load_before`` counts.
    """
    running = load_before if running_before is None else running_before
    past = max(load_before - running, 0.0) * math.exp(-max(seconds, 0.0) / 60.0)
    return max(running, load_after - own_load(own_threads, seconds) - past, 0.0)


def judge(spread: float, load_before: float, load_after: float, *, cpus: int, own_threads: int,
          seconds: float, running_before: float | None = None, spread_limit: float = SPREAD_LIMIT,
          load_per_core_limit: float = LOAD_PER_CORE_LIMIT) -> Steadiness:
    """Steady or not, from the micro-benchmarks' spread and the load around the calibration
    (:func:`others_load`)."""
    if cpus < 1:
        raise ValueError(f"cpus must be >= 1, got {cpus}")
    others = others_load(load_before, load_after, own_threads=own_threads, seconds=seconds,
                         running_before=running_before)
    reasons = []
    if spread > spread_limit:
        reasons.append(f"micro-benchmark medians uncertain by {spread * 100:.0f}% (limit {spread_limit * 100:.0f}%)")
    if others > load_per_core_limit * cpus:
        reasons.append(f"other jobs kept a load of about {others:.1f} on {cpus} core(s) "
                       f"(limit {load_per_core_limit * cpus:.1f})")
    return Steadiness(not reasons, spread, load_before, load_after, others, cpus, tuple(reasons))


def half_width(steadiness: Steadiness | None, validation: ValidationError = VALIDATION) -> float:
    """The relative error an interval allows: the model's worst validated error, plus the
    calibration's spread when the calibration was unsteady (its numbers may be off by as much)."""
    width = validation.abs_worst
    if steadiness is not None and not steadiness.steady:
        width += max(steadiness.spread, 0.1)
    return min(width, WIDEST)


def interval(predicted_s: float, width: float) -> list[float]:
    """Where the measured time lies if the prediction errs by at most ``width`` either way
    (error = predicted / measured - 1, so measured = predicted / (1 + error))."""
    return [predicted_s / (1.0 + width), predicted_s / (1.0 - width)]


def within_noise(best_s: float, default_s: float, steadiness: Steadiness | None,
                 validation: ValidationError = VALIDATION) -> bool:
    """Whether the predicted gain over the default is below what the model can resolve: the worst
    shape error (plus the calibration's spread when it was unsteady)."""
    noise = validation.shape_worst
    if steadiness is not None and not steadiness.steady:
        noise += max(steadiness.spread, 0.1)
    return default_s - best_s < noise * default_s
