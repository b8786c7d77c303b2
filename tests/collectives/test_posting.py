"""The order in which the ring posts its messages, recorded on a fake process group (no processes).

Gloo writes a send on the calling thread only if the peer's receive is already posted, and on
its event-loop thread otherwise (gloo/transport/tcp/pair.cc), so the order is a performance
choice (see ring.ring_pass); these tests pin it down and check that an early receive never lands
in a scratch slot whose piece is still to be reduced.
"""

import pytest
import torch

from commlab.collectives import ring
from commlab.collectives.p2p import TAG_SPAN, Comm, release_group_state


class _Work:
    def __init__(self, log, event):
        self.log, self.event = log, event

    def wait(self):
        self.log.append(("wait", *self.event[1:]))
        return True


class _FakeGroup:
    """Records every send/recv: (kind, tag, data_ptr, numel)."""

    def __init__(self):
        self.log = []

    def recv(self, tensors, src, tag):
        event = ("recv", tag, tensors[0].data_ptr(), tensors[0].numel())
        self.log.append(event)
        return _Work(self.log, event)

    def send(self, tensors, dst, tag):
        event = ("send", tag, tensors[0].data_ptr(), tensors[0].numel())
        self.log.append(event)
        return _Work([], event)


def _run(world: int, numel: int, piece_bytes: int, monkeypatch) -> list:
    pg = _FakeGroup()
    comm = Comm(None, 1, world, tuple(range(world)), False, pg, tag=7)
    monkeypatch.setattr(ring, "combine_", lambda acc, incoming, op: pg.log.append(("combine", incoming.data_ptr())))
    try:
        ring.ring_pass(torch.zeros(numel), "sum", comm, reduce_scatter=True, all_gather=True, piece_bytes=piece_bytes)
    finally:
        release_group_state([pg])
    return pg.log


@pytest.mark.parametrize("world", [2, 3, 4])
def test_step_zero_sends_go_first_then_every_all_gather_receive_on_its_own_tag(world, monkeypatch):
    log = _run(world, 960, 64, monkeypatch)  # equal blocks of 16-element pieces, many per block
    first_recv = next(i for i, e in enumerate(log) if e[0] == "recv")
    first_wait = next(i for i, e in enumerate(log) if e[0] == "wait")
    assert first_recv == 960 // world // 16 and all(e[0] == "send" and e[1] == 7 for e in log[:first_recv])
    ag_recvs = [i for i, e in enumerate(log) if e[0] == "recv" and e[1] == 7 + TAG_SPAN]
    rs_recvs = [i for i, e in enumerate(log) if e[0] == "recv" and e[1] == 7]
    assert ag_recvs and max(ag_recvs) < first_wait
    assert len(rs_recvs) > ring.WINDOW and sum(i < first_wait for i in rs_recvs) == ring.WINDOW
    # With equal blocks, what this rank sends on a tag is what its right neighbour receives on it.
    for tag in (7, 7 + TAG_SPAN):
        sends = [e[3] for e in log if e[0] == "send" and e[1] == tag]
        recvs = [e[3] for e in log if e[0] == "recv" and e[1] == tag]
        assert sends == recvs and sum(sends) == (world - 1) * 960 // world


@pytest.mark.parametrize("world", [2, 4])
def test_next_receive_is_posted_before_the_reduction_and_never_into_a_pending_slot(world, monkeypatch):
    log = _run(world, 1000, 64, monkeypatch)
    in_flight: list[int] = []  # scratch addresses posted (receiving or received) and not yet reduced
    waits_then_posts = 0
    for i, e in enumerate(log):
        if e[0] == "recv" and e[1] == 7:
            assert e[2] not in in_flight, "a receive landed in a slot whose piece is not reduced yet"
            in_flight.append(e[2])
            waits_then_posts += i > 0 and log[i - 1][0] == "wait"
        elif e[0] == "combine":
            assert in_flight.pop(0) == e[1]  # pieces are reduced in arrival order
        assert len(in_flight) <= ring.WINDOW + 1
    rs_total = sum(e[0] == "recv" and e[1] == 7 for e in log)
    assert waits_then_posts == rs_total - ring.WINDOW  # every later receive right after a wait, before its combine


def test_halving_doubling_sends_its_first_step_first_and_posts_every_doubling_receive_up_front(monkeypatch):
    from commlab.collectives import halving_doubling as hd
    from commlab.collectives.schedules import chunk_bounds, hd_all_gather_steps, hd_reduce_scatter_steps

    world, rank, numel = 4, 1, 960
    pg = _FakeGroup()
    comm = Comm(None, rank, world, tuple(range(world)), False, pg, tag=7)
    monkeypatch.setattr(hd, "PIECE_BYTES", 64)  # 16-element pieces: several per exchanged range
    monkeypatch.setattr(hd, "combine_", lambda acc, incoming, op: pg.log.append(("combine", incoming.data_ptr())))
    flat = torch.zeros(numel)
    try:
        hd.all_reduce_halving_doubling(flat, "sum", comm)
    finally:
        release_group_state([pg])
    log, base, size = pg.log, flat.data_ptr(), flat.element_size()
    halving, doubling = hd_reduce_scatter_steps(rank, world), hd_all_gather_steps(rank, world)
    bounds = chunk_bounds(numel, world)

    def span(blocks):
        return bounds[blocks[0]][0], bounds[blocks[1] - 1][1]

    first = span(halving[0].send)
    n_first = (first[1] - first[0]) // 16
    # Step 0's sends before anything else, then its receives, then every doubling receive (tag 2).
    assert [e[0] for e in log[:n_first]] == ["send"] * n_first and all(e[1] == 7 for e in log[:n_first])
    first_wait = next(i for i, e in enumerate(log) if e[0] == "wait")
    early = log[n_first:first_wait]
    gathered = [e for e in early if e[1] == 7 + TAG_SPAN]
    assert all(e[0] == "recv" for e in early) and len(gathered) == len(doubling)
    # Each doubling receive lands in place, in the range sent to that peer while halving.
    sent_ranges = sorted(span(s.send) for s in halving)
    landed = sorted(((e[2] - base) // size, (e[2] - base) // size + e[3]) for e in gathered)
    assert landed == sent_ranges
    # Later halving steps post their receives before their sends; the doubling sends come last.
    later = log[first_wait:]
    step1_recv = next(i for i, e in enumerate(later) if e[0] == "recv")
    step1_send = next(i for i, e in enumerate(later) if e[0] == "send")
    assert step1_recv < step1_send
    doubling_sends = [e for e in log if e[0] == "send" and e[1] == 7 + TAG_SPAN]
    assert len(doubling_sends) == len(doubling) and log.index(doubling_sends[0]) > max(
        i for i, e in enumerate(log) if e[0] == "combine"
    )
