"""The DDP lowering against timelines computed by hand (no processes, no calibration)."""

import pytest

from commlab.costmodel.lowering.ddp import (
    DDPSetting,
    StepCosts,
    assign_buckets,
    breakdown,
    lower,
    simulate_step,
)
from tests.support.step_costs import MIB, costs


def run(c: StepCosts, s: DDPSetting):
    result, buckets = simulate_step(c, s)
    return result, buckets, *breakdown(result, buckets, c)


def test_overlap_launches_each_bucket_when_its_gradient_is_ready():
    result, buckets, row, rows = run(costs(), DDPSetting(bucket_cap_mb=1))
    assert buckets == [[1], [0]]
    # forward 0-.2; grad1 .2-.3; launch0 .3-.31; ar0 .31-.36; grad0 .31-.51; launch1 .51-.52;
    # ar1 .52-.57; writeback0 .52-.54; writeback1 .57-.59; optimizer .59-.62
    assert [r[k] for r in rows for k in ("ready", "launched", "done")] == pytest.approx([.3, .3, .36, .51, .51, .57])
    assert row == pytest.approx({"forward": .2, "backward_compute": .31, "comm": .27, "exposed_comm": .06,
                                 "total": .59, "write_back": .04, "unused_allreduce": 0.0, "accumulate_time": 0.0, "optimizer": .03, "step": .62})


def test_overlap_off_launches_after_backward_in_order_on_one_channel():
    _, _, row, rows = run(costs(), DDPSetting(bucket_cap_mb=1, overlap=False))
    # grad0 .3-.5; launch0 .5-.51; ar0 .51-.56; launch1 .51-.52; ar1 waits for the channel .56-.61
    assert [r[k] for r in rows for k in ("launched", "done")] == pytest.approx([.5, .56, .51, .61])
    assert row["total"] == pytest.approx(.63) and row["step"] == pytest.approx(.66)
    assert row["exposed_comm"] == pytest.approx(.11)  # last ready .5 -> last done .61 (write-back excluded)


def test_round_robin_channels_share_the_link():
    _, _, row, rows = run(costs(), DDPSetting(bucket_cap_mb=1, overlap=False, groups=2))
    # ar0 alone .51-.52 (0.01 done), then both at half speed: ar0's last 0.04 takes until .60;
    # ar1 did 0.04 by then and ends alone at .61.
    assert [r["done"] for r in rows] == pytest.approx([.60, .61])
    assert row["total"] == pytest.approx(.64)


def test_contention_slows_backward_while_a_bucket_is_reduced():
    _, _, row, rows = run(costs(kc=1.0), DDPSetting(bucket_cap_mb=1))
    # grad0 runs at half speed while ar0 runs (.31-.36): 0.025 of its 0.2 done, the rest alone.
    assert rows[1]["ready"] == pytest.approx(.535)
    assert row["backward_compute"] == pytest.approx(.335)


def test_one_bucket_no_sync_and_co_run():
    _, buckets, row, rows = run(costs(corun=1.5), DDPSetting(bucket_cap_mb=25, accumulate=3))
    assert buckets == [[1, 0]]
    # no_sync 2 x .4 x 1.5 = 1.2; forward .3; grads .15 and .3 -> ready at .75 after t0 (= 1.2);
    # launch and write-back are not stretched: done .75 + .01 + .1, written back .04 later
    assert row["accumulate_time"] == pytest.approx(1.2)
    assert rows[0]["ready"] == pytest.approx(.75) and rows[0]["launched"] == pytest.approx(.75)
    assert rows[0]["done"] == pytest.approx(.86)
    assert row["total"] == pytest.approx(.90)
    assert row["step"] == pytest.approx(1.2 + .90 + .045)


def test_buckets_follow_ddp_assignment_and_first_bucket_cap():
    c = costs(ready_s=(.1, .2, .3, .4), ready_order=(3, 2, 1, 0), param_nbytes=(MIB,) * 4)
    assert assign_buckets(c, DDPSetting(bucket_cap_mb=2)) == [[3, 2], [1, 0]]
    assert assign_buckets(c, DDPSetting(bucket_cap_mb=3, first_bucket_mb=1)) == [[3], [2, 1, 0]]
    assert assign_buckets(c, DDPSetting()) == [[3], [2, 1, 0]]  # torch default: 1 MiB first, 25 MiB


def test_lowering_rejects_inconsistent_costs():
    with pytest.raises(ValueError):
        lower(costs(ready_s=(0.1,)), DDPSetting(), [[1], [0]])
    with pytest.raises(ValueError):
        DDPSetting(groups=0)


def test_two_lanes_run_queued_all_reduces_at_once_with_the_measured_gain():
    # Overlap off: both buckets launch after backward (.5 and .51), 0.05 s of all-reduce each.
    # One lane: FIFO, .51-.56 then .56-.61 (the test above). Two lanes, gain 1.2: ar0 alone
    # .51-.52 (0.01 done), then both at 0.6: ar0's last 0.04 takes 1/15 s; ar1 has 0.01 left
    # and ends alone.
    _, _, row, rows = run(costs(lanes=2, lane_gain=1.2), DDPSetting(bucket_cap_mb=1, overlap=False))
    t0 = .52 + .04 / .6
    assert [r["done"] for r in rows] == pytest.approx([t0, t0 + (.05 - .04)])
    # gain 1: two lanes only share the link; the last all-reduce ends when FIFO's would
    _, _, row1, rows1 = run(costs(lanes=2, lane_gain=1.0), DDPSetting(bucket_cap_mb=1, overlap=False))
    assert rows1[-1]["done"] == pytest.approx(.61) and rows[-1]["done"] < .61 - 0.005
