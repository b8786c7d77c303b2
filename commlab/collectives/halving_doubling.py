"""Rabenseifner's all-reduce: recursive-halving reduce-scatter + recursive-doubling all-gather.

Following Thakur, Rabenseifner & Gropp, "Optimization of collective communication operations in
MPICH" (IJHPCA 2005), section 4.4. With p' the largest power of two <= p:

1. fold (only when p is not a power of two): among the first 2(p - p') ranks each even rank
   sends its whole vector to its odd neighbour, which reduces the two and stands in for the pair;
2. log2 p' halving steps: exchange half of the current range with the partner at distance
   p'/2, p'/4, ..., 1, reduce the half kept; each rank ends owning one reduced block of p';
3. log2 p' doubling steps, in reverse: exchange owned ranges, each step doubling them;
4. unfold: each stand-in sends the result back to its folded even neighbour.

Every step is one exchange with one partner, so the latency term is 2 log2 p' (+2 when folding)
instead of the ring's 2(p-1), at the same 2(p-1)/p n bytes for powers of two. The index maths
is in :mod:`commlab.collectives.schedules`.

Segmenting (Gloo): a halving step's exchange is posted as pieces of ``PIECE_BYTES``, all at
once (the whole received half has its place in the scratch), and each piece is reduced as soon
as it has arrived, so the reduction of one piece overlaps the transfer of the next, as in the
ring. Both partners cut the exchanged range identically, so the pieces pair up in order.
"""

from __future__ import annotations

import torch

from commlab.collectives.p2p import Comm, wait_all
from commlab.collectives.reduce_ops import combine_, finish_
from commlab.collectives.schedules import (
    chunk_bounds,
    pieces,
    hd_all_gather_steps,
    hd_fold,
    hd_reduce_scatter_steps,
    largest_power_of_two,
)


PIECE_BYTES = 2 << 20


def _exchange_and_reduce(
    comm: Comm, flat: torch.Tensor, scratch: torch.Tensor, send: tuple[int, int], recv: tuple[int, int],
    peer: int, op: str, sent: list,
) -> None:
    """One halving step: send ``flat[send]``, receive the peer's ``recv`` range into ``scratch``
    and reduce it into ``flat[recv]`` piece by piece as the pieces arrive."""
    (sa, sb), (ra, rb) = send, recv
    if comm.coalesce:  # NCCL pipelines inside its one grouped call
        _exchange(comm, flat[sa:sb], scratch[: rb - ra], peer, sent)
        combine_(flat[ra:rb], scratch[: rb - ra], op)
        return
    piece = max(1, PIECE_BYTES // flat.element_size())
    arriving = pieces(ra, rb, piece)
    recv_works, send_works = comm.post(
        sends=[(flat[a:b], peer) for a, b in pieces(sa, sb, piece)],
        recvs=[(scratch[a - ra : b - ra], peer) for a, b in arriving],
    )
    sent.extend(send_works)
    for (a, b), work in zip(arriving, recv_works):
        work.wait()
        combine_(flat[a:b], scratch[a - ra : b - ra], op)


def _exchange(comm: Comm, send: torch.Tensor, recv: torch.Tensor, peer: int, sent: list) -> None:
    """Swap with ``peer``; wait for the receive only (a send's buffer is not written again
    within its phase, and ``sent`` is drained between phases)."""
    recv_works, send_works = comm.post(sends=[(send, peer)], recvs=[(recv, peer)])
    sent.extend(send_works)
    wait_all(recv_works)


def all_reduce_halving_doubling(flat: torch.Tensor, op: str, comm: Comm) -> None:
    n, p = flat.numel(), comm.size
    if p == 1 or n == 0:
        finish_(flat, op, p)
        return
    role, virtual, partner = hd_fold(comm.rank, p)
    if role == "folded":  # steps 1 and 4 only: hand the vector over, get the result back
        wait_all(comm.post(sends=[(flat, partner)])[1])
        wait_all(comm.post(recvs=[(flat, partner)])[0])
        return
    if role == "proxy":
        incoming = comm.scratch("halving_doubling", n, flat)
        wait_all(comm.post(recvs=[(incoming, partner)])[0])
        combine_(flat, incoming, op)

    bounds = chunk_bounds(n, largest_power_of_two(p))

    def span(blocks: tuple[int, int]) -> tuple[int, int]:
        return bounds[blocks[0]][0], bounds[blocks[1] - 1][1]

    halving = hd_reduce_scatter_steps(virtual, p)
    # Reused across calls (p2p.Comm.scratch): half the largest message stays allocated.
    largest = max((span(s.recv)[1] - span(s.recv)[0] for s in halving), default=0)
    scratch = comm.scratch("halving_doubling", largest, flat)
    sent: list = []
    for step in halving:
        _exchange_and_reduce(comm, flat, scratch, span(step.send), span(step.recv), step.peer, op, sent)
    lo, hi = bounds[virtual]
    finish_(flat[lo:hi], op, p)
    wait_all(sent)  # the all-gather receives into the ranges the halving sent
    sent.clear()
    for step in hd_all_gather_steps(virtual, p):
        (sa, sb), (ra, rb) = span(step.send), span(step.recv)
        _exchange(comm, flat[sa:sb], flat[ra:rb], step.peer, sent)
    wait_all(sent)

    if role == "proxy":
        wait_all(comm.post(sends=[(flat, partner)])[1])
