"""Pulling W next to its I (a fused backward) where the simulated step does not grow: no processes."""

import pytest

from commlab.pipeline import build, simulate, v_shape, check_schedule
from commlab.pipeline.schedule.actions import as_actions
from commlab.pipeline.schedule.fuse import FUSED, durations, fused, pull_weights, step_time
from commlab.pipeline.schedule.zero_bubble import _greedy_zb_v


def _split(actions) -> int:
    return sum(1 for rank in actions for k, a in enumerate(rank) if a.kind == "I" and not fused(rank, k))


def test_a_fused_pair_costs_its_share_on_the_i_and_nothing_on_the_w():
    (rank,) = as_actions([["0F0", "0I0", "0W0", "0F1", "0I1", "0F2", "0W1"]])
    assert [fused(rank, k) for k in range(len(rank))] == [False, True, False, False, False, False, False]
    d = durations((rank,), forward=1.0, backward=2.0)
    assert [d[a] for a in rank] == [1.0, 2 * FUSED, 0.0, 1.0, 1.0, 1.0, 1.0]


def test_pulling_weights_keeps_each_ranks_actions_the_step_and_the_peak_and_fuses_more():
    for p, m in ((2, 4), (2, 8), (3, 6)):
        greedy = _greedy_zb_v(p, m)
        pulled = pull_weights(greedy)
        check_schedule(pulled, m, 2 * p, v_shape(p))
        assert [sorted(map(str, r)) for r in pulled] == [sorted(map(str, r)) for r in greedy]
        before = simulate(greedy, durations=durations(greedy), comm=0.3)
        after = simulate(pulled, durations=durations(pulled), comm=0.3)
        assert after.step_time <= before.step_time + 1e-9
        assert max(after.peak_in_flight) <= max(before.peak_in_flight)
        assert _split(pulled) < _split(greedy)
        assert build("zb-v", p, m, 2) == pulled  # the registered zb-v is the pulled list
    # at world 2, m = 4: 5 of 16 backwards split, where the greedy list split 11 (torch's
    # ScheduleZBVZeroBubble, which merges each adjacent I and W into one full backward, splits 3)
    assert (_split(_greedy_zb_v(2, 4)), _split(build("zb-v", 2, 4, 2))) == (11, 5)


def test_a_list_whose_weights_all_follow_their_input_gradients_is_left_alone():
    one = build("1f1b", 2, 4)
    split = tuple(tuple(b for a in rank for b in ((a.at(a.stage, "I"), a.at(a.stage, "W")) if a.kind == "B" else (a,)))
                  for rank in one)  # fmt: skip
    assert _split(split) == 0 and pull_weights(split) == split


def test_the_fast_step_time_is_the_simulators():
    from commlab.pipeline import from_csv
    from tests.support.pipeline_torch_orders import torch_csv

    lists = [_greedy_zb_v(2, 4), build("zb-v", 3, 6, 2), build("zb-h1", 3, 5),
             from_csv(torch_csv("ScheduleZBVZeroBubble", 2, 8, [0, 3], 4))]  # fmt: skip
    for actions in lists:
        for comm in (0.0, 0.3):
            seconds = durations(actions)
            assert step_time(actions, seconds, comm) == pytest.approx(simulate(actions, durations=seconds, comm=comm).step_time)
    stuck = as_actions([["0F0", "0I0", "0W0"], ["1I0", "1F0", "1W0"]])  # 1I0 before its own forward
    with pytest.raises(ValueError, match="deadlocks"):
        step_time(stuck, {a: 1.0 for rank in stuck for a in rank}, 0.0)
