"""The co-run stretch: measured inside the profile (every rank runs its own DDP loop while rank 0
profiles), so a calibration stretches nothing again; the lowering still applies factors stated
elsewhere (pure, no processes)."""

import pytest

from commlab.costmodel.calibration.driver import assemble, spread_of
from commlab.costmodel.lowering.ddp import DDPSetting, StepCosts, breakdown, simulate_step, step_costs
from commlab.costmodel.search.predict import profile_from_entry, system_from_entry

MIB = 1 << 20


def test_the_profiles_repetitions_count_in_the_calibrations_spread():
    quiet = [{"collective_samples": {}, "ddp": {"step_samples": [1.0] * 9}}]
    burst = [{"collective_samples": {}, "ddp": {"step_samples": [1.0, 2.0, 1.0, 2.0, 2.0, 1.0, 2.0, 1.0, 2.0]}}]
    assert spread_of(quiet) == 0.0 and spread_of(burst) > 0.05


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


def _rank() -> dict:
    ddp = {"forward_s": 0.01, "ready_s": [0.01], "ready_order": [0], "optimizer_s": 0.005, "nosync_s": 0.0,
           "writeback_s_per_byte": 1e-10, "bucket_fixed_s": 0.0, "exposed_s": 0.0, "small_run": {}}
    return {"ddp": ddp, "collectives": {"native": [0.01, 0.08]}, "contention": {}}


def _entry(results: list[dict]) -> dict:
    return assemble(results, {"algorithms": ["native"], "sizes": [MIB, 8 * MIB]}, [8 * MIB], [(2 * MIB,)],
                    {"model": "mlp"})


def test_a_calibration_prices_its_profile_as_measured_beside_the_other_ranks():
    entry = _entry([_rank(), _rank(), _rank()])
    c = entry["compute"]
    assert c["profiled_beside_ranks"] == 3
    costs = step_costs(system_from_entry(entry, 3), profile_from_entry(entry), "native", 3)
    assert (costs.corun, costs.optimizer_stretch(), costs.copy_stretch()) == (1.0, 1.0, 1.0)
    row = _step(costs)
    assert row["forward"] == pytest.approx(0.01) and row["optimizer"] == pytest.approx(0.005)


def test_an_entry_made_before_keeps_its_turns_factors():
    entry = _entry([_rank(), _rank()])
    entry["compute"].update(corun=1.2, corun_optimizer=2.0)
    del entry["compute"]["corun_copy"]
    costs = step_costs(system_from_entry(entry, 2), profile_from_entry(entry), "native", 2)
    assert (costs.corun, costs.optimizer_stretch(), costs.copy_stretch()) == pytest.approx((1.2, 2.0, 1.0))

