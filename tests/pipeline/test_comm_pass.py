"""The comm pass and liveness: pure functions over the lists every reader shares, as literal lists."""

import pytest

from commlab.pipeline import REGISTRY, build, liveness, lower_comm, peak_in_flight, send_waits
from commlab.costmodel.planner.plan import peak_bytes
from commlab.pipeline.schedule.comm import Comm, compute_only
from commlab.pipeline.schedule.actions import flatten
from commlab.pipeline.schedule.checks import comm_problems


def _lines(lowered):
    return [" ".join(str(op).replace(" ", "_") for op in rank) for rank in lowered]


def test_1f1b_lowered_for_gloo_and_nccl():
    # Gloo: a rank posts its next receive right after its previous receiving action; NCCL: with
    # the sends of the action before the one receiving (torch's Schedule1F1B pairing).
    assert _lines(lower_comm(build("1f1b", 2, 2), backend="gloo")) == [
        "RECV_1B0>0B0 0F0 SEND_0F0>1F0 WAIT_SEND_0F0>1F0 0F1 SEND_0F1>1F1 WAIT_SEND_0F1>1F1 WAIT_RECV_1B0>0B0 0B0 "
        "RECV_1B1>0B1 WAIT_RECV_1B1>0B1 0B1",
        "RECV_0F0>1F0 WAIT_RECV_0F0>1F0 1F0 RECV_0F1>1F1 1B0 SEND_1B0>0B0 WAIT_SEND_1B0>0B0 WAIT_RECV_0F1>1F1 1F1 "
        "1B1 SEND_1B1>0B1 WAIT_SEND_1B1>0B1",
    ]
    assert _lines(lower_comm(build("1f1b", 2, 2), backend="nccl")) == [
        "0F0 SEND_0F0>1F0 WAIT_SEND_0F0>1F0 0F1 SEND_0F1>1F1 RECV_1B0>0B0 WAIT_SEND_0F1>1F1 WAIT_RECV_1B0>0B0 0B0 "
        "RECV_1B1>0B1 WAIT_RECV_1B1>0B1 0B1",
        "RECV_0F0>1F0 WAIT_RECV_0F0>1F0 1F0 1B0 SEND_1B0>0B0 RECV_0F1>1F1 WAIT_SEND_1B0>0B0 WAIT_RECV_0F1>1F1 1F1 "
        "1B1 SEND_1B1>0B1 WAIT_SEND_1B1>0B1",
    ]
    with pytest.raises(ValueError, match="unknown backend 'mpi'"):
        lower_comm(build("1f1b", 2, 2), backend="mpi")


def test_every_schedule_lowers_to_lists_that_cannot_hang():
    for name, spec in REGISTRY.items():
        v = 1 if spec.virtual is None else spec.virtual[0]
        for p, m in ((2, 4), (3, 6), (4, 8)):
            actions = build(name, p, m, v if name != "interleaved" else 2)
            for backend in ("gloo", "nccl"):
                lowered = lower_comm(actions, backend=backend)
                assert compute_only(lowered) == flatten(actions)  # the pass only adds communication, and opens overlaps
                assert comm_problems(lowered) == [], (name, p, m, backend)
                ops = [op for rank in lowered for op in rank if isinstance(op, Comm)]
                sends = {op.message for op in ops if op.kind == "SEND"}
                # Every message sent, received, waited for once by each side.
                assert {op.message for op in ops if op.kind == "RECV"} == sends
                assert sorted(str(op.message) for op in ops if op.kind == "WAIT") == sorted(str(s) for s in sends for _ in "sr")
    # Waiting on a send before the receiver can post its receive hangs a Gloo rank: found.
    rank0, rank1 = lower_comm(build("gpipe", 2, 1))
    stuck = (rank0, (*rank1[1:], rank1[0]))  # rank 1 posts its receive last: both ranks wait forever
    assert "deadlocks" in comm_problems(stuck)[0]


def test_send_waits_are_read_off_the_lowered_lists():
    waits = send_waits(build("1f1b", 2, 4))
    rank0 = build("1f1b", 2, 4)[0]
    assert waits[rank0[2]] == (rank0[1],)  # 0F1's send is awaited just before 0B0, as in lower_comm


def test_liveness_is_the_one_count_of_what_is_alive():
    zbh1 = build("zb-h1", 2, 3)
    lives = liveness(zbh1)
    # Rank 1 keeps micro-batch 0 alive through its I until its W (held back by one micro-batch).
    assert [(str(live.action), sorted(live.alive), live.freed) for live in lives[1]][:5] == [
        ("1F0", [(1, 0)], ()), ("1I0", [(1, 0)], ()), ("1F1", [(1, 0), (1, 1)], ()),
        ("1I1", [(1, 0), (1, 1)], ()), ("1W0", [(1, 0), (1, 1)], ((1, 0),)),
    ]  # fmt: skip
    assert peak_in_flight(zbh1) == (2, 2)
    # Checkpointed: only the input is held until the backward recomputes the forward.
    gp = build("gpipe", 2, 2)
    assert [live.alive for live in liveness(gp, checkpointed=[0, 1])[0]] == [
        {(0, 0): False}, {(0, 0): False, (0, 1): False}, {(0, 0): True, (0, 1): False}, {(0, 1): True}]
    # The planner's peak is that count priced: 2 inputs of 1 byte, then one recomputed (+ 10).
    assert peak_bytes(gp, (0, 1), [10.0, 10.0], [1.0, 1.0], [0.0, 0.0], [0, 1])[0] == 12.0 + 2 * 1.0
