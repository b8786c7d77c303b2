"""Any schedule, without processes: the registry, I/W actions, placements, torch's CSV, zero bubble, send waits."""

import itertools

import pytest

from commlab.pipeline import (
    REGISTRY,
    Action,
    ScheduleSpec,
    as_actions,
    build,
    check_plan,
    format_actions,
    from_csv,
    message_order,
    placement_of,
    register,
    resolve,
    send_waits,
    simulate,
    to_csv,
    v_shape,
    check_schedule,
)
from commlab.pipeline.schedule.comm import messages
from commlab.pipeline.schedule.checks import problems
from tests.support.pipeline_torch_orders import torch_csv, torch_dualpipev


def test_actions_have_four_kinds_and_torch_strings():
    assert [Action.parse(t) for t in ("0F1", "0B1", "0I1", "0W1")] == [Action(0, k, 1) for k in "FBIW"]
    assert str(Action(12, "W", 3)) == "12W3"
    assert as_actions([["0F0", Action(0, "B", 0)], ["1F0", "1B0"]])[0] == (Action(0, "F", 0), Action(0, "B", 0))
    with pytest.raises(ValueError, match="list of actions per rank"):
        as_actions("0F0 0B0")
    assert v_shape(3) == (0, 1, 2, 2, 1, 0)


def test_registry_is_the_one_list_of_schedules():
    assert {"gpipe", "1f1b", "interleaved", "zb-h1", "zb-v"} <= set(REGISTRY)
    assert REGISTRY["zb-v"].placement(2, 4) == (0, 1, 1, 0) and REGISTRY["1f1b"].placement(2, 2) == (0, 1)
    assert REGISTRY["zb-h1"].kinds == {"F", "I", "W"}
    with pytest.raises(ValueError, match="'zb-v' runs 2 stage"):
        build("zb-v", 2, 4, 1)
    # Adding a schedule touches one place; the executor's resolve() and check_plan see it at once.
    register(ScheduleSpec("reverse-gpipe", lambda p, m, v: tuple(
        tuple(Action(r, "F", i) for i in range(m)) + tuple(Action(r, "B", i) for i in reversed(range(m)))
        for r in range(p))))  # fmt: skip
    try:
        assert check_plan("reverse-gpipe", 2, 2, 3) == 1
        assert format_actions(resolve("reverse-gpipe", 2, 3, 2))[0] == "0F0 0F1 0F2 0B2 0B1 0B0"
    finally:
        del REGISTRY["reverse-gpipe"]


def test_validate_checks_microbatches_stages_and_placement():
    ok = as_actions([["0F0", "0F1", "0B0", "0B1"], ["1F0", "1B0", "1F1", "1B1"]])
    check_schedule(ok, microbatches=2, stages=2, placement=[0, 1])
    assert "the schedule has 2 micro-batches, expected 3" in problems(ok, microbatches=3)
    assert "the schedule has 2 stages, expected 4" in problems(ok, stages=4)
    assert any("stage 0 lives on rank 1" in p for p in problems(ok, placement=[1, 0]))
    assert any("outside 0..1" in p for p in problems(ok, placement=[0, 2]))
    split = as_actions([["0F0", "0I0", "0W0"], ["1F0", "1I0", "1W0"]])
    check_schedule(split)
    assert any("0W0 is missing" in p for p in problems(as_actions([["0F0", "0I0"], ["1F0", "1B0"]])))
    assert any("both B and I/W" in p for p in problems(as_actions([["0F0", "0B0", "0I0", "0W0"], ["1F0", "1B0"]])))
    assert any("I before its W" in p for p in problems(as_actions([["0F0", "0W0", "0I0"], ["1F0", "1B0"]])))


def test_torch_compute_only_csv_round_trips_and_runs_here():
    # Made by torch's own schedule code; m = 3 is not a multiple of p = 2.
    for name in ("ScheduleLoopedBFS", "ScheduleInterleaved1F1B"):
        text = torch_csv(name, 2, 3, [0, 2], 4)
        actions = from_csv(text)
        check_schedule(actions, microbatches=3, stages=4, placement=[0, 1, 0, 1])
        assert message_order(actions) == []
        assert from_csv(to_csv(actions)) == actions
    assert format_actions(from_csv(torch_csv("ScheduleLoopedBFS", 2, 3, [0, 2], 4)))[0] == (
        "0F0 0F1 0F2 2F0 2F1 2F2 2B2 2B1 2B0 0B2 0B1 0B0")
    # torch's zero-bubble orders (I and W) pass the checks too, the V one with its own placement.
    zbv = from_csv(torch_csv("ScheduleZBVZeroBubble", 2, 4, [0, 3], 4))
    assert placement_of(zbv) == (0, 1, 1, 0)
    check_schedule(zbv, microbatches=4, stages=4, placement=v_shape(2))
    check_schedule(from_csv(torch_csv("ScheduleInterleavedZeroBubble", 2, 4, [0, 2], 4)), microbatches=4, stages=4)
    with pytest.raises(ValueError, match="communication action"):
        from_csv("0F0,0SEND_F0\n1RECV_F0,1F0\n")
    assert from_csv("0F0,,0REDUCE_GRAD,0B0\n") == ((Action(0, "F", 0), Action(0, "B", 0)),)


def test_looped_bfs_and_interleaved_zb_are_registered_by_name():
    # looped-bfs is torch's ScheduleLoopedBFS order, rank for rank (its idle steps dropped).
    for p, m, v in [(2, 3, 2), (3, 6, 2), (2, 4, 3), (4, 5, 2)]:
        ours = build("looped-bfs", p, m, v)
        assert ours == from_csv(torch_csv("ScheduleLoopedBFS", p, m, list(range(0, p * v, p)), p * v))
        check_schedule(ours, microbatches=m, stages=p * v, placement=[s % p for s in range(p * v)])
    # interleaved-zb: interleaved 1F1B's forwards, each B split into I then W, rank r's W held back r.
    assert format_actions(build("interleaved-zb", 2, 4, 2))[1] == (
        "1F0 1F1 3F0 3I0 3F1 3I1 3W0 1F2 1I0 3W1 1F3 1I1 1W0 3F2 3I2 1W1 3F3 3I3 3W2 1I2 3W3 1I3 1W2 1W3")
    for p, m, v in [(2, 4, 2), (3, 6, 2), (4, 8, 3)]:
        zb, base = build("interleaved-zb", p, m, v), build("interleaved", p, m, v)
        check_schedule(zb, microbatches=m, stages=p * v)
        assert [[a for a in r if a.kind == "F"] for r in zb] == [[a for a in r if a.kind == "F"] for r in base]
    with pytest.raises(ValueError, match="multiple of the ranks"):
        build("interleaved-zb", 2, 3, 2)


def test_dualpipev_is_torchs_order_on_the_v():
    for p, m in [(2, 4), (2, 5), (3, 6), (3, 11), (4, 9)]:
        ours = build("dualpipev", p, m, 2)
        check_schedule(ours, microbatches=m, stages=2 * p, placement=v_shape(p))
        assert [[str(a) for a in rank] for rank in ours] == [torch_dualpipev(p, m, r) for r in range(p)]
    with pytest.raises(ValueError, match="at least as many micro-batches as stages"):
        build("dualpipev", 2, 3, 2)


def test_dualpipev_overlap_action_validates_simulates_and_round_trips():
    from commlab.pipeline.schedule.actions import flatten, overlap
    from commlab.pipeline.schedule.liveness import peak_in_flight
    from commlab.pipeline.schedule.render import grid

    for p, m in [(2, 4), (2, 6), (2, 9)]:  # world 2: torch's order, O actions where torch overlaps
        ours = build("dualpipev", p, m, 2)
        assert [[str(a) for a in rank] for rank in ours] == [torch_dualpipev(p, m, r) for r in range(p)]
    # tests/pipeline/test_traced.py's world-2 run (m=4) has three pairs per rank: its loss, gradients
    # and eval equal the unpartitioned model's and torch's ScheduleDualPipeV's.
    assert [sum(a.kind == "O" for a in rank) for rank in build("dualpipev", 2, 4, 2)] == [3, 3]
    acts = build("dualpipev", 2, 6, 2)
    pairs = [a for rank in acts for a in rank if a.kind == "O"]
    assert pairs and str(pairs[0]) == "0F3+3B1" and pairs[0].parts == tuple(map(Action.parse, ("0F3", "3I1", "3W1")))
    assert all(Action.parse(str(a)) == a for a in pairs) and from_csv(to_csv(acts)) == acts
    with pytest.raises(ValueError, match="another stage"):
        overlap(Action(0, "F", 1), 0, 0)  # a pair is two chunks of one rank
    check_schedule(acts, microbatches=6, stages=4, placement=v_shape(2))
    assert peak_in_flight(acts) == peak_in_flight(flatten(acts))
    cells = [line.split() for line in grid(acts).replace("~", "").splitlines()]
    assert cells == [line.split() for line in grid(flatten(acts)).splitlines()] and {"0F3~", "3I1~"} <= set(grid(acts).split())
    # Simulated: the pair's parts run back to back on the rank (both computes), and the forward's
    # message is in flight while the backward computes.
    sim = simulate(acts, forward=1.0, backward=2.0, comm=0.5)
    when = {t.action: t for t in sim.timeline}
    sent = {msg.sent_by: (start, end) for msg, start, end in sim.messages}
    assert all(when[a.parts[2]].end - when[a.parts[0]].start >= 3.0 for a in pairs)
    hidden = [a for a in pairs if a.parts[0] in sent and when[a.parts[1]].start < sent[a.parts[0]][1]]
    assert hidden and all(sent[a.parts[0]][0] == when[a.parts[0]].end for a in hidden)
    bad = [list(rank) for rank in acts]
    bad[0][bad[0].index(pairs[0])] = overlap(Action(0, "F", 3), 3, 2)  # backward of the wrong micro-batch
    assert any("appears twice" in p or "missing" in p for p in problems(as_actions(bad), 6, 4, v_shape(2)))


def test_zb_h1_literal_lists_and_memory():
    assert format_actions(build("zb-h1", 3, 4)) == [
        "0F0 0F1 0F2 0I0 0W0 0F3 0I1 0W1 0I2 0W2 0I3 0W3",  # rank 0 holds back no W
        "1F0 1F1 1I0 1F2 1I1 1W0 1F3 1I2 1W1 1I3 1W2 1W3",  # rank 1 one
        "2F0 2I0 2F1 2I1 2F2 2I2 2W0 2F3 2I3 2W1 2W2 2W3",  # rank 2 two: they fill the cool-down
    ]
    for p, m in itertools.product(range(2, 6), (4, 8, 16)):
        actions = build("zb-h1", p, m)
        check_schedule(actions, m, p)
        assert message_order(actions) == []
        # Same peak as 1F1B (p micro-batches, on rank 0); later ranks use the slack.
        assert max(simulate(actions).peak_in_flight) == max(simulate(build("1f1b", p, m)).peak_in_flight)


def test_zero_bubble_schedules_beat_1f1b_in_simulation():
    for p, m in itertools.product((2, 3, 4), (4, 8, 16)):
        for comm in (0.0, 0.3):  # free messages, and messages of 0.3 of a rank's forward
            one_f = simulate(build("1f1b", p, m), 1.0, 2.0, comm)
            zbh1 = simulate(build("zb-h1", p, m), 1.0, 2.0, comm)  # I = W = 1
            # The V schedule's stages are half a rank's layers each: half the time per action.
            zbv = simulate(build("zb-v", p, m, 2), 0.5, 1.0, comm)
            # Not zb-v < zb-h1: built for messages that cost time, zb-v trails zb-h1 when they are
            # free at some (p, m) (docs/design.md, zero bubble); test_zb_v_keeps_up_... checks it.
            assert zbh1.bubble < one_f.bubble and zbv.bubble < one_f.bubble
        # Qi et al.: ZB-H1's bubble is (p-1)(F+I-W) = (p-1) here, 1F1B's (p-1)(F+B) = 3(p-1).
        assert simulate(build("zb-h1", p, m), 1.0, 2.0).step_time - 3 * m == pytest.approx(p - 1)
        check_schedule(build("zb-v", p, m, 2), m, 2 * p, v_shape(p))


def test_zb_v_keeps_up_with_torchs_order_when_messages_cost_time():
    # The greedy zb-v is built with one action of message time (zero_bubble.LATENCY): against
    # torch's ScheduleZBVZeroBubble order, simulated with messages of 0.3 of an action, it ends
    # within one action of it (the zero-latency greedy was 8.4 actions, 9%, behind at m = 16) and
    # holds no more activations.
    for m in (4, 8, 16):
        ours = simulate(build("zb-v", 2, m, 2), 1.0, 2.0, 0.3)
        theirs = simulate(from_csv(torch_csv("ScheduleZBVZeroBubble", 2, m, [0, 3], 4)), 1.0, 2.0, 0.3)
        assert ours.step_time <= theirs.step_time + 1.0
        assert max(ours.peak_in_flight) <= max(theirs.peak_in_flight)


def test_send_waits_release_sends_early_without_deadlock():
    for name, v in (("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zb-h1", 1), ("zb-v", 2)):
        for p, m in ((2, 4), (3, 6)):
            actions = build(name, p, m, v)
            waits = send_waits(actions)
            sent = {a for _, a, _, _ in messages(actions)}
            awaited = [w for ws in waits.values() for w in ws]
            assert len(awaited) == len(set(awaited)) and set(awaited) <= sent
            # Most sends are released before the end of the step (the last few cannot be).
            assert len(awaited) >= len(sent) - 2 * p * v, (name, p, len(awaited), len(sent))
            position = {a: k for rank in actions for k, a in enumerate(rank)}
            assert all(position[w] < position[b] for b, ws in waits.items() for w in ws)
    # 1F1B rank 0: the activation sent by F(k) is awaited before the next action after F(k+1)'s
    # receive was posted: exactly torch's Schedule1F1B pattern.
    waits = send_waits(build("1f1b", 2, 4))
    assert waits[Action(0, "B", 0)] == (Action(0, "F", 1),) and waits[Action(1, "F", 1)] == (Action(1, "B", 0),)


def test_show_reads_torch_csv_and_lists_every_registered_schedule(tmp_path):
    from click.testing import CliRunner

    from commlab.cli import main

    path = tmp_path / "zbv.csv"
    path.write_text(torch_csv("ScheduleZBVZeroBubble", 2, 4, [0, 3], 4))
    result = CliRunner().invoke(main, ["pipeline", "show", "--csv", str(path), "--actions"])
    assert result.exit_code == 0, result.output
    assert result.output.splitlines()[0].startswith("rank 0: 0F0 0F1 0F2 3F0 3I0 3W0")
    result = CliRunner().invoke(main, ["pipeline", "show", "--schedule", "zb-v", "-p", "2", "-m", "4"])
    assert result.exit_code == 0 and "3I0" in result.output
    path.write_text("0F0,0SEND_F0\n")
    result = CliRunner().invoke(main, ["pipeline", "show", "--csv", str(path)])
    assert result.exit_code == 2 and "communication action" in result.output
