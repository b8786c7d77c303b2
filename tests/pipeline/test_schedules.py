"""Schedules, validator, simulator and grid: pure functions, checked without processes."""

import itertools

import pytest

from commlab.pipeline import (
    Action,
    DeadlockError,
    build,
    bubble_formula,
    check_plan,
    format_actions,
    gpipe,
    grid,
    interleaved,
    message_order,
    one_f_one_b,
    peak_in_flight,
    simulate,
    check_schedule,
)
from commlab.pipeline.schedule.checks import problems


def _parse(lines):
    return tuple(tuple(Action.parse(a) for a in line.split()) for line in lines)


def test_action_compact_form_round_trips():
    a = Action(1, "F", 0)
    assert str(a) == "1F0" and Action.parse("1F0") == a
    assert Action.parse("12B34") == Action(12, "B", 34)
    with pytest.raises(ValueError, match="cannot parse"):
        Action.parse("1X0")
    with pytest.raises(ValueError, match="kind"):
        Action(0, "X", 0)


def test_gpipe_is_fill_drain():
    assert format_actions(gpipe(2, 3)) == ["0F0 0F1 0F2 0B0 0B1 0B2", "1F0 1F1 1F2 1B0 1B1 1B2"]


def test_1f1b_has_warmup_steady_and_cooldown():
    assert format_actions(one_f_one_b(3, 4)) == [
        "0F0 0F1 0F2 0B0 0F3 0B1 0B2 0B3",  # warm-up 2, steady 2 pairs, cool-down 2
        "1F0 1F1 1B0 1F2 1B1 1F3 1B2 1B3",  # warm-up 1
        "2F0 2B0 2F1 2B1 2F2 2B2 2F3 2B3",  # last stage: no warm-up
    ]
    # Fewer micro-batches than stages: warm-up is capped at m.
    assert format_actions(one_f_one_b(4, 2))[0] == "0F0 0F1 0B0 0B1"


def test_interleaved_follows_megatron_order():
    # p=2, v=2: rank 0 holds stages 0 and 2; micro-batches go through chunks in groups of p.
    assert format_actions(interleaved(2, 4, 2)) == [
        "0F0 0F1 2F0 2F1 0F2 2B0 0F3 2B1 2F2 0B0 2F3 0B1 2B2 2B3 0B2 0B3",
        "1F0 1F1 3F0 3B0 3F1 3B1 1F2 1B0 1F3 1B1 3F2 3B2 3F3 3B3 1B2 1B3",
    ]
    with pytest.raises(ValueError, match="multiple of the ranks"):
        interleaved(4, 6, 2)


def test_every_generated_schedule_is_valid_and_nccl_ordered():
    for p, m in itertools.product(range(1, 6), range(1, 9)):
        for name in ("gpipe", "1f1b"):
            actions = build(name, p, m)
            check_schedule(actions)
            assert message_order(actions) == []
        for v in (2, 3):
            if m % p == 0:
                actions = interleaved(p, m, v)
                check_schedule(actions)
                assert message_order(actions) == []
                assert sum(len(r) for r in actions) == 2 * p * v * m


def test_producer_is_the_inverse_of_consumer():
    # The executor's transport sends to consumer() and receives from producer(): one rule both ways.
    from commlab.pipeline.schedule.kinds import consumer, producer
    from commlab.pipeline.schedule.kinds import split_stages

    F, B, I, W = "F", "B", "I", "W"
    assert producer(Action(1, F, 2), 3, frozenset()) == Action(0, F, 2)
    assert producer(Action(0, B, 2), 3, frozenset({1})) == Action(1, I, 2)  # stage 1's backward is split
    assert producer(Action(1, I, 2), 3, frozenset({1})) == Action(2, B, 2)
    assert [producer(Action(s, k, 0), 3, frozenset({0, 1, 2})) for s, k in ((0, F), (2, B), (2, I), (1, W))] == [None] * 4
    for name, p, m, v in (("gpipe", 3, 4, 1), ("1f1b", 3, 4, 1), ("interleaved", 2, 4, 2), ("zb-h1", 3, 4, 1), ("zb-v", 2, 4, 2)):
        actions = build(name, p, m, v)
        stages, split = p * v, split_stages(actions)
        every = {a for rank in actions for a in rank}
        sent = {a: consumer(a, stages, split) for a in every}
        assert all(producer(c, stages, split) == a for a, c in sent.items() if c is not None), name
        needs = {a: producer(a, stages, split) for a in every}
        assert all(p in every and consumer(p, stages, split) == a for a, p in needs.items() if p is not None), name
        assert sum(c is not None for c in sent.values()) == sum(q is not None for q in needs.values()) == 2 * (stages - 1) * m


def test_validator_names_each_broken_rule():
    backward_first = _parse(["0B0 0F0", "1F0 1B0"])
    assert any("before 0F0 (forward before its backward)" in p for p in problems(backward_first))
    missing = _parse(["0F0 0F1 0B0", "1F0 1B0 1F1 1B1"])
    assert "0B1 is missing" in problems(missing)
    misplaced = _parse(["0F0 1F0 1B0 0B0", ""])
    assert any("stage 1 lives on rank 1" in p for p in problems(misplaced, placement=[0, 1]))
    assert any("ranks [1] have no actions" in p for p in problems(misplaced))
    twice = _parse(["0F0 0F0 0B0", "1F0 1B0"])
    assert "0F0 appears twice" in problems(twice)
    # Each rank waits on the other: rank 0 needs 1B0 before 0F1, rank 1 runs 1B0 after 1F1.
    deadlock = _parse(["0F0 0B0 0F1 0B1", "1F1 1B1 1F0 1B0"])
    with pytest.raises(ValueError, match="deadlocks"):
        check_schedule(deadlock)
    with pytest.raises(DeadlockError):
        simulate(deadlock)
    # Messages that a rank consumes out of the sender's order are fine for Gloo tags, not for NCCL.
    reordered = _parse(["0F0 0F1 0B0 0B1", "1F1 1F0 1B0 1B1"])
    check_schedule(reordered)
    assert message_order(reordered) and "rank 0 sends" in message_order(reordered)[0]


def test_uniform_bubble_matches_the_formulas():
    for p, m in itertools.product(range(1, 6), range(1, 9)):
        for name in ("gpipe", "1f1b"):
            sim = simulate(build(name, p, m), forward=1.0, backward=2.0)
            assert sim.step_time == pytest.approx((m + p - 1) * 3.0)
            assert sim.bubble == pytest.approx(bubble_formula(p, m)) == pytest.approx((p - 1) / (m + p - 1))
            assert sim.idle == pytest.approx([(p - 1) * 3.0] * p)
        for v in (2, 4):
            if m % p == 0:
                # v chunks per rank, each 1/v of a rank's work: the bubble shrinks by v.
                sim = simulate(interleaved(p, m, v), forward=1.0 / v, backward=2.0 / v)
                assert sim.bubble == pytest.approx((p - 1) / (v * m + p - 1))


def test_uneven_stages_and_communication_cost():
    # GPipe, p=2, m=4, stage 1 three times slower: worked by hand.
    # rank1 forwards end at 4, 7, 10, 13; its backwards 13-19 ... 31-37; rank 0's last ends 37+2.
    sim = simulate(gpipe(2, 4), forward=[1, 3], backward=[2, 6])
    assert sim.step_time == 39.0
    assert sim.busy == (12.0, 36.0) and sim.idle == (27.0, 3.0)
    # One micro-batch, two ranks: each of the two crossings costs c.
    assert simulate(gpipe(2, 1), 1.0, 2.0, comm=0.5).step_time == pytest.approx(6.0 + 2 * 0.5)
    # Replaying individual action times: one slow forward on rank 0 delays everything after it.
    slow = simulate(gpipe(2, 2), 1.0, 1.0, durations={Action(0, "F", 0): 3.0})
    assert slow.step_time == simulate(gpipe(2, 2), 1.0, 1.0).step_time + 2.0
    with pytest.raises(ValueError, match="one time per stage"):
        simulate(gpipe(2, 1), forward=[1.0, 2.0, 3.0])


def test_peak_micro_batches_in_flight():
    assert peak_in_flight(gpipe(4, 8)) == (8, 8, 8, 8)
    assert peak_in_flight(one_f_one_b(4, 8)) == (4, 3, 2, 1)  # p - s: 1F1B's memory bound
    assert peak_in_flight(one_f_one_b(4, 2)) == (2, 2, 2, 1)
    assert simulate(one_f_one_b(4, 8)).peak_in_flight == (4, 3, 2, 1)
    inter = peak_in_flight(interleaved(2, 4, 2))
    assert len(inter) == 4 and max(inter) <= 4 and inter[-1] == 1


def test_grid_shows_clock_ticks():
    assert grid(gpipe(2, 2)) == "\n".join([
        "step rank0 rank1",
        "   0   0F0     .",
        "   1   0F1   1F0",
        "   2     .   1F1",
        "   3     .   1B0",
        "   4   0B0   1B1",
        "   5   0B1     .",
    ])


def test_plans_are_checked_before_any_process_starts():
    assert check_plan("1f1b", 2, 2, 4) == 1
    assert check_plan("interleaved", 4, 2, 4) == 2
    with pytest.raises(ValueError, match="'1f1b' runs 1 stage\\(s\\) per rank, not 2"):
        check_plan("1f1b", 4, 2, 4)
    with pytest.raises(ValueError, match="every rank needs a stage"):
        check_plan("gpipe", 2, 4, 4)
    with pytest.raises(ValueError, match="divide evenly"):
        check_plan("interleaved", 5, 2, 4)
    with pytest.raises(ValueError, match="unknown schedule"):
        check_plan("zero-bubble", 2, 2, 4)
    with pytest.raises(ValueError, match="unknown checkpoint"):
        check_plan("gpipe", 2, 2, 4, checkpoint="sometimes")
    with pytest.raises(ValueError, match="micro-batches"):
        check_plan("gpipe", 2, 2, 0)
    with pytest.raises(ValueError, match="multiple of the ranks"):
        check_plan("interleaved", 4, 2, 3)
