"""Benchmark arithmetic: size sweeps, nccl-tests' bus bandwidth, and the alpha-beta fit.

Bus bandwidth (nccl-tests, doc/PERFORMANCE.md): algbw = S / t is what an application sees, but
it falls as ranks are added because each byte has to cross more links. busbw rescales it to the
bandwidth of the busiest link, so that it can be compared with the hardware's and across world
sizes: busbw = algbw x the bytes each rank moves per byte of buffer (commlab/runs/traffic.py).

The alpha-beta (latency-bandwidth, Hockney) model says one collective on S bytes takes
t = alpha + S / beta; :func:`fit_alpha_beta` estimates it by least squares over a size sweep
with both terms non-negative (:func:`nonnegative_line`): a latency below zero means nothing, and an
unconstrained line through noisy small sizes gave one (a negative alpha printed without comment).
:func:`least_squares_line` is the unconstrained fit, which the pipeline planner's ping-pong fit uses.
"""

from __future__ import annotations

import math

import numpy as np

from commlab.runs.traffic import bus_factor


def size_sweep(min_bytes: int, max_bytes: int, factor: int, element_size: int) -> list[int]:
    """Message sizes from min to max (inclusive when hit), each ``factor`` times the last.

    Each is rounded down to whole elements (at least one), as nccl-tests does; duplicates after
    rounding are dropped.
    """
    if min_bytes > max_bytes:
        raise ValueError(f"min size {min_bytes} B is larger than max size {max_bytes} B")
    if factor < 2:
        raise ValueError(f"step factor must be an integer >= 2, got {factor}")
    sizes, size = [], min_bytes
    while size <= max_bytes:
        rounded = max(element_size, size // element_size * element_size)
        if not sizes or rounded != sizes[-1]:
            sizes.append(rounded)
        size *= factor
    return sizes


def busbw_factor(collective: str, world_size: int) -> float:
    """nccl-tests' bus-bandwidth factor of ``collective`` on ``world_size`` ranks."""
    if world_size < 1:
        raise ValueError(f"world size must be >= 1, got {world_size}")
    return bus_factor(collective, world_size)


def bandwidths(nbytes: int, seconds: float, collective: str, world_size: int) -> tuple[float, float]:
    """(algbw, busbw) in GB/s (1e9 bytes per second, as nccl-tests)."""
    algbw = nbytes / seconds / 1e9 if seconds > 0 else math.nan
    return algbw, algbw * busbw_factor(collective, world_size)


def least_squares_line(x, y) -> tuple[float, float]:
    """Ordinary least squares ``y = intercept + slope * x``: returns (intercept, slope), unclamped.

    (NaN, NaN) when ``x`` has fewer than two distinct values (the line is not determined). The
    centred closed form: sizes in bytes reach 1e9 and more, where the normal equations on
    [1, x] lose digits that centring keeps.
    """
    x = np.asarray(x, dtype=float)
    y = np.asarray(y, dtype=float)
    if x.ndim != 1 or x.shape != y.shape:
        raise ValueError(f"sizes and times must be two sequences of the same length, got {len(x)} and {len(y)}")
    if len(np.unique(x)) < 2:
        return math.nan, math.nan
    dx = x - x.mean()
    slope = float((dx * (y - y.mean())).sum() / (dx * dx).sum())
    return float(y.mean() - slope * x.mean()), slope


def nonnegative_line(x, y) -> tuple[float, float]:
    """Least squares ``y = intercept + slope * x`` with intercept >= 0 and slope >= 0.

    Two parameters, so a closed form: the residual is a convex quadratic, whose minimum over the
    quadrant is the unconstrained one when that lies inside, and otherwise the best of the
    minimum along each edge (intercept 0: slope = sum(xy)/sum(xx); slope 0: intercept = mean(y)),
    each clipped at zero. (NaN, NaN) as :func:`least_squares_line` when undetermined.
    """
    intercept, slope = least_squares_line(x, y)
    if math.isnan(slope) or (intercept >= 0 and slope >= 0):
        return intercept, slope
    x = np.asarray(x, dtype=float)
    y = np.asarray(y, dtype=float)
    edges = [(0.0, max(float((x * y).sum() / (x * x).sum()), 0.0)), (max(float(y.mean()), 0.0), 0.0)]
    return min(edges, key=lambda e: float(((y - e[0] - e[1] * x) ** 2).sum()))


def fit_alpha_beta(nbytes, seconds) -> tuple[float, float, float]:
    """Least-squares fit of t = alpha + S / beta, alpha >= 0 and 1/beta >= 0 (:func:`nonnegative_line`):
    returns (alpha in us, beta in GB/s, R^2).

    NaNs where the data cannot determine them (fewer than two distinct sizes); beta is inf when
    the time does not grow with size over the sweep (no bandwidth term is measurable there: sizes
    too small, or noise larger than the transfer time).
    """
    alpha, slope = nonnegative_line(nbytes, seconds)
    if math.isnan(slope):
        return math.nan, math.nan, math.nan
    x = np.asarray(nbytes, dtype=float)
    y = np.asarray(seconds, dtype=float)
    residual = float(((y - (alpha + slope * x)) ** 2).sum())
    total = float(((y - y.mean()) ** 2).sum())
    r2 = 1.0 - residual / total if total > 0 else 1.0
    beta = 1.0 / slope / 1e9 if slope > 0 else math.inf
    return alpha * 1e6, beta, r2
