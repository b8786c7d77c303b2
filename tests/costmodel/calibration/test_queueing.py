"""Queued all-reduces: the paired-time table from calibration to the lowering's gain (pure, no processes)."""

import pytest

from commlab.costmodel.calibration.driver import assemble
from commlab.costmodel.terms.costs import CollectiveCost, Contention, DDPProfile, SystemCosts
from commlab.costmodel.lowering.ddp import DDPSetting, simulate_step, step_costs
from commlab.costmodel.calibration.queueing import MAX_QUEUE, paired_seconds, queue_length
from commlab.costmodel.search.predict import system_from_entry

MIB = 1 << 20


def test_queue_length_is_about_the_models_bytes_within_bounds():
    assert queue_length(4 * MIB, 48 * MIB) == 12
    assert queue_length(64 << 10, 48 * MIB) == MAX_QUEUE
    assert queue_length(48 * MIB, 48 * MIB) == 2  # never one: a queue needs two to pair


def test_paired_seconds_take_the_odd_last_call_off_at_the_tables_time():
    # 4 calls of 1 s in 2.5 s: 0.625 s each while paired; 3 calls in 2 s: the last alone (1 s),
    # the other two in 1 s: 0.5 s each; a queue faster than two lanes is held at half the table.
    assert paired_seconds([1.0, 1.0, 1.0], [4, 3, 4], [2.5, 2.0, 1.0]) == pytest.approx([0.625, 0.5, 0.5])
    with pytest.raises(ValueError):
        paired_seconds([1.0], [2, 2], [1.0])


def test_gain_by_size_is_the_table_over_the_paired_time_clipped():
    c = Contention(lanes=2, lane_gain=1.3)
    assert c.gain_at(MIB, 0.01) == 1.3  # nothing measured by size: the one number
    paired = CollectiveCost((MIB, 16 * MIB), (0.008, 0.010))
    c = Contention(lanes=2, lane_gain=1.3, paired=paired)
    assert c.gain_at(MIB, 0.010) == pytest.approx(1.25)  # faster two at a time
    assert c.gain_at(16 * MIB, 0.008) == pytest.approx(0.8)  # slower two at a time than one after another
    assert c.gain_at(16 * MIB, 0.001) == 0.5 and c.gain_at(MIB, 0.1) == 2.0


def _profile(n: int) -> DDPProfile:
    return DDPProfile(forward_s=0.01, ready_s=tuple(0.01 * (j + 1) for j in range(n)), ready_order=tuple(range(n)),
                      param_nbytes=(MIB,) * n, optimizer_s=0.001, nosync_s=0.0)


def test_overlap_off_queue_is_priced_at_the_measured_paired_time():
    # Four 1 MiB buckets queued after backward on two lanes, 10 ms each alone. Measured paired
    # time 12.5 ms (gain 0.8): two pairs of 25 ms -> the last bucket done 50 ms after the first
    # launch (plus launches); the pair measured once on warm buffers (gain 1.6) said 25 ms.
    table = CollectiveCost((MIB, 4 * MIB), (0.010, 0.040))
    done = {}
    for name, contention in (("queued", Contention(lanes=2, lane_gain=1.6, paired=CollectiveCost((MIB, 4 * MIB), (0.0125, 0.05)))),
                             ("pair", Contention(lanes=2, lane_gain=1.6))):
        system = SystemCosts(collectives={("allreduce", "native", 2): table}, contention={"native": contention})
        costs = step_costs(system, _profile(4), "native", 2)
        result, buckets = simulate_step(costs, DDPSetting(bucket_cap_mb=1, overlap=False))
        assert len(buckets) == 4
        done[name] = max(s.end for k, s in result.spans.items() if k.startswith("allreduce")) - result.spans["launch0"].start
    assert done["queued"] == pytest.approx(0.050, abs=1e-9)
    assert done["pair"] == pytest.approx(0.025, abs=1e-9)


def _rank(queued_s: float, table: list[float]) -> dict:
    ddp = {"forward_s": 0.01, "ready_s": [0.01], "ready_order": [0], "optimizer_s": 0.001, "nosync_s": 0.0,
           "writeback_s_per_byte": 0.0, "bucket_fixed_s": 0.0, "exposed_s": 0.0, "small_run": {}}
    return {"ddp": ddp, "collectives": {"native": table}, "contention": {},
            "corun": {"alone_s": 1.0, "together_s": 1.0},
            "queue": {"native": {"sizes": [MIB, 8 * MIB], "k": [8, 2], "queued_s": [queued_s, 0.1]}}}


def test_calibration_keeps_the_slowest_ranks_queue_as_a_paired_table_and_prediction_reads_it():
    spec = {"algorithms": ["native"], "sizes": [MIB, 8 * MIB]}
    results = [_rank(0.050, [0.010, 0.080]), _rank(0.060, [0.012, 0.070])]
    entry = assemble(results, spec, [8 * MIB], [(2 * MIB,)], {"model": "mlp"})
    c = entry["concurrency"]["native"]
    # slowest rank: table 12 ms / 80 ms, queue 60 ms for 8 x 1 MiB and 100 ms for 2 x 8 MiB
    assert c["paired_s"] == pytest.approx([0.0075, 0.05])
    assert c["gain"] == pytest.approx(0.08 / 0.05)  # the size nearest 8 MiB
    system = system_from_entry({**entry, "contention": {}}, 2)
    costs = step_costs(system, _profile(1), "native", 2)
    assert costs.lane_gain_at(MIB) == pytest.approx(0.012 / 0.0075)
    assert costs.lane_gain_at(8 * MIB) == pytest.approx(1.6)


def test_write_back_beside_a_collective_uses_the_copys_own_factors():
    from commlab.costmodel.lowering.ddp import contention_rate
    from commlab.sim import Task

    ar, wb, grad = (Task("ar", "chan0", 1.0, (), "allreduce", "rank"), Task("wb", "compute", 1.0, (), "writeback", "rank"),
                    Task("g", "compute", 1.0, (), "backward", "rank"))
    rate = contention_rate(kc=0.5, km=1.0, copy=(0.25, 3.0))
    assert rate(ar, [wb]) == pytest.approx(1 / 4) and rate(wb, [ar]) == pytest.approx(1 / 1.25)
    assert rate(ar, [grad]) == pytest.approx(1 / 2) and rate(grad, [ar]) == pytest.approx(1 / 1.5)
    assert rate(ar, []) == 1.0 and rate(wb, []) == 1.0
    same = contention_rate(kc=0.5, km=1.0)  # not measured: the model's factors
    assert same(ar, [wb]) == pytest.approx(1 / 2) and same(wb, [ar]) == pytest.approx(1 / 1.5)


def test_calibration_solves_the_copys_contention_and_prediction_binds_it():
    spec = {"algorithms": ["native"], "sizes": [MIB, 8 * MIB]}
    results = [_rank(0.050, [0.010, 0.080]), _rank(0.050, [0.010, 0.080])]
    # copy alone 10 ms, collective alone 10 ms; together the copy ends at 12.5 ms (kc 0.25) and
    # the collective at 20 ms: 12.5/(1+km) done by then, the rest alone -> km = 3
    results[0]["copy_contention"] = {"native": {"compute_alone_s": 0.010, "comm_alone_s": 0.010,
                                                "compute_both_s": 0.0125, "comm_both_s": 0.0125 + 0.010 - 0.0125 / 4}}
    results[0]["contention"] = {"native": {"compute_alone_s": 0.1, "comm_alone_s": 0.1, "compute_both_s": 0.1,
                                           "comm_both_s": 0.1}}
    entry = assemble(results, spec, [8 * MIB], [(2 * MIB,)], {"model": "mlp"})
    k = entry["contention"]["native"]
    assert k["kc_copy"] == pytest.approx(0.25) and k["km_copy"] == pytest.approx(3.0)
    costs = step_costs(system_from_entry(entry, 2), _profile(1), "native", 2)
    assert (costs.kc_copy, costs.km_copy) == pytest.approx((0.25, 3.0)) and costs.kc == 0.0


def test_the_backward_is_the_profiled_one_whatever_the_bucket_layout():
    # With glibc's thresholds fixed in calibration and measurement alike, a gradient's faults are
    # decided by its size, not by the buckets (commlab/_malloc.py): the profile's ready times
    # hold for every layout, so one bucket of four and four of one end backward alike.
    table = CollectiveCost((MIB, 4 * MIB), (0.010, 0.040))
    system = SystemCosts(collectives={("allreduce", "native", 2): table})
    ends = set()
    for cap in (1, 2, 4, 64):
        result, buckets = simulate_step(step_costs(system, _profile(4), "native", 2),
                                        DDPSetting(bucket_cap_mb=cap, overlap=False))
        ends.add(round(result.spans["grad3"].end - result.spans["forward"].end, 12))
    assert ends == {0.040}
