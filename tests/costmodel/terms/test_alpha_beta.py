"""The alpha-beta fit keeps latency and inverse bandwidth non-negative (a closed-form two-term NNLS)."""

import math

import numpy as np
import pytest

from commlab.costmodel.terms.alpha_beta import fit_alpha_beta, least_squares_line, nonnegative_line


def _brute_force(x, y):
    # The constrained optimum on a fine grid around the candidates, as an oracle.
    x, y = np.asarray(x, float), np.asarray(y, float)
    best = None
    for a in np.linspace(0, 2 * max(y), 401):
        b = max(float(((y - a) * x).sum() / (x * x).sum()), 0.0)  # exact in b for fixed a
        r = float(((y - a - b * x) ** 2).sum())
        best = min(best or (r, a, b), (r, a, b))
    return best


def test_a_line_with_negative_intercept_is_fitted_with_zero_latency():
    sizes = [1 << k for k in range(10, 21)]
    times = [-20e-6 + s / 1e9 for s in sizes]  # unconstrained: alpha -20 us
    assert least_squares_line(sizes, times)[0] < 0
    intercept, slope = nonnegative_line(sizes, times)
    assert intercept == 0.0 and slope > 0
    r_fit = float(((np.asarray(times) - intercept - slope * np.asarray(sizes, float)) ** 2).sum())
    assert r_fit <= _brute_force(sizes, times)[0] * (1 + 1e-9)
    alpha_us, beta_gbps, r2 = fit_alpha_beta(sizes, times)
    assert alpha_us == 0.0 and math.isfinite(beta_gbps) and beta_gbps > 0 and r2 <= 1.0


def test_time_falling_with_size_gives_a_flat_line_not_a_negative_bandwidth():
    intercept, slope = nonnegative_line([8, 16, 32], [3.0, 2.0, 1.0])
    assert (intercept, slope) == pytest.approx((2.0, 0.0))  # the mean: no bandwidth term measurable
    assert fit_alpha_beta([8, 16, 32], [3.0, 2.0, 1.0])[:2] == (pytest.approx(2e6), math.inf)


def test_an_unconstrained_fit_inside_the_quadrant_is_unchanged():
    sizes, times = [1, 2, 3, 4], [1.1, 1.9, 3.2, 3.9]
    assert nonnegative_line(sizes, times) == least_squares_line(sizes, times)
    assert all(math.isnan(v) for v in nonnegative_line([8, 8], [1.0, 2.0]))
