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


# The optimizer's and the write-back's own co-run stretches: from calibration's turns into the
# entry, from the entry into the lowering, and the fallback for entries made before them.

from commlab.costmodel.calibration.driver import assemble  # noqa: E402
from commlab.costmodel.lowering.ddp import DDPSetting, StepCosts, breakdown, simulate_step, step_costs  # noqa: E402
from commlab.costmodel.search.predict import profile_from_entry, system_from_entry  # noqa: E402

MIB = 1 << 20


def _costs(**over) -> StepCosts:
    # One 1 MiB parameter; compute co-run 1.2, no contention: the timeline is a straight line.
    base = dict(forward_s=0.2, ready_s=(0.1,), ready_order=(0,), param_nbytes=(MIB,), optimizer_s=0.03, nosync_s=0.0,
                writeback_s_per_byte=0.02 / MIB, bucket_fixed_s=0.01, corun=1.2, kc=0.0, km=0.0,
                allreduce=lambda nbytes: 0.05)
    return StepCosts(**{**base, **over})


def _step(costs: StepCosts) -> dict:
    result, buckets = simulate_step(costs, DDPSetting(bucket_cap_mb=25))
    return breakdown(result, buckets, costs)[0]


def test_the_optimizer_and_the_write_back_take_their_own_stretch_and_the_model_keeps_the_computes():
    row = _step(_costs(corun_optimizer=2.0, corun_copy=1.5))
    # forward .24, backward .12 (x1.2); launch .01 and all-reduce .05 unstretched; write-back .02 x1.5,
    # optimizer .03 x2
    assert row["forward"] == pytest.approx(0.24) and row["backward_compute"] == pytest.approx(0.12)
    assert row["write_back"] == pytest.approx(0.03) and row["optimizer"] == pytest.approx(0.06)
    assert row["step"] == pytest.approx(0.24 + 0.12 + 0.01 + 0.05 + 0.03 + 0.06)


def test_without_their_own_stretch_the_optimizer_takes_the_computes_and_the_write_back_none():
    row = _step(_costs())
    assert row["optimizer"] == pytest.approx(0.036) and row["write_back"] == pytest.approx(0.02)


def _rank(**corun) -> dict:
    ddp = {"forward_s": 0.01, "ready_s": [0.01], "ready_order": [0], "optimizer_s": 0.005, "nosync_s": 0.0,
           "writeback_s_per_byte": 1e-10, "bucket_fixed_s": 0.0, "exposed_s": 0.0, "small_run": {}}
    return {"ddp": ddp, "collectives": {"native": [0.01, 0.08]}, "contention": {},
            "corun": {"alone_s": 0.04, "together_s": 0.048}, **corun}


def _entry(results: list[dict]) -> dict:
    return assemble(results, {"algorithms": ["native"], "sizes": [MIB, 8 * MIB]}, [8 * MIB], [(2 * MIB,)],
                    {"model": "mlp"})


def test_calibration_stores_each_stretch_from_its_quickest_turns_and_prediction_binds_them():
    # the optimizer: 6 ms alone at best, 12 ms together at best (a burst doubled other turns)
    optimizer = {"alone_s": 0.007, "together_s": 0.02, "alone_samples": [0.006, 0.007, 0.012],
                 "together_samples": [0.024, 0.012, 0.022]}
    copy = {"alone_s": 0.006, "together_s": 0.009, "alone_samples": [0.006], "together_samples": [0.009, 0.012]}
    entry = _entry([_rank(corun_optimizer=optimizer, corun_copy=copy), _rank()])
    c = entry["compute"]
    assert c["corun_optimizer"] == pytest.approx(2.0) and c["corun_copy"] == pytest.approx(1.5)
    assert c["corun_optimizer_raw"] == optimizer  # the turns kept, as the compute's are
    costs = step_costs(system_from_entry(entry, 2), profile_from_entry(entry), "native", 2)
    assert (costs.corun, costs.optimizer_stretch(), costs.copy_stretch()) == pytest.approx((1.2, 2.0, 1.5))
    # one rank has nothing to share: no stretch of any kind
    alone = step_costs(system_from_entry(entry, 1), profile_from_entry(entry), "native", 1)
    assert (alone.corun, alone.optimizer_stretch(), alone.copy_stretch()) == (1.0, 1.0, 1.0)


def test_an_entry_made_before_the_memory_stretches_prices_the_step_as_before():
    entry = _entry([_rank(), _rank()])
    assert "corun_optimizer" not in entry["compute"] and "corun_copy" not in entry["compute"]
    costs = step_costs(system_from_entry(entry, 2), profile_from_entry(entry), "native", 2)
    assert costs.optimizer_stretch() == pytest.approx(1.2) and costs.copy_stretch() == 1.0


def test_a_memory_stretch_never_shrinks_the_work():
    # quicker together than alone (noise): the step is not made quicker than one rank's
    entry = _entry([_rank(corun_optimizer={"alone_s": 0.01, "together_s": 0.009}), _rank()])
    assert entry["compute"]["corun_optimizer"] == 1.0
