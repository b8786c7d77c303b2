"""The co-run factor from calibration's turns (pure, no processes)."""

import pytest

from commlab.costmodel.calibration.driver import corun_factor, spread_of


def test_corun_is_the_quickest_together_over_the_quickest_alone():
    # A burst of another job doubled three of the together turns and one alone turn: the medians
    # would say 1.75, the ranks' own contention is 1.2.
    corun = {"alone_s": 0.040, "together_s": 0.070, "alone_samples": [0.040, 0.041, 0.080, 0.040],
             "together_samples": [0.096, 0.048, 0.098, 0.050, 0.097]}
    assert corun_factor(corun) == pytest.approx(1.2)


def test_corun_without_samples_is_the_ratio_of_the_medians():
    assert corun_factor({"alone_s": 0.040, "together_s": 0.050}) == pytest.approx(1.25)
    assert corun_factor({"alone_s": 0.0, "together_s": 0.050}) == 1.0


def test_the_corun_turns_count_in_the_calibrations_spread():
    quiet = [{"collective_samples": {}, "ddp": {"step_samples": [1.0] * 9}, "corun": {"together_samples": [1.0] * 9}}]
    burst = [{**quiet[0], "corun": {"together_samples": [1.0, 2.0, 1.0, 2.0, 2.0, 1.0, 2.0, 1.0, 2.0]}}]
    assert spread_of(quiet) == 0.0 and spread_of(burst) > 0.05
