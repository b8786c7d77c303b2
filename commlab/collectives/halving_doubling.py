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

Steps 2 and 3 alone are a reduce-scatter (:func:`reduce_scatter_halving`) and an all-gather
(:func:`all_gather_doubling`), the pair sharded data parallelism uses. They leave rank r with
block r of p, so they exist for power-of-two world sizes only: a fold would leave the folded
ranks without a block (ValueError naming the ring, which takes any size).

Segmenting and posting order (Gloo), as in the ring (ring.ring_pass says why): a halving step's
exchange is posted as 2 MiB pieces (p2p.PIECE_BYTES), each reduced as soon as it has arrived;
both partners cut the range identically, so the pieces pair up in order. The first step's sends go out before any receive.
Every doubling receive is posted right after that, on the collective's second tag, straight into its place:
the doubling step with peer q receives the range this rank sent q while halving, fully reduced,
so it cannot arrive before q has received (and this rank has finished sending) that range.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from commlab.collectives.p2p import PIECE_BYTES, Comm, wait_all
from commlab.collectives.reduce_ops import combine_, finish_
from commlab.collectives.schedules import (
    check_power_of_two,
    chunk_bounds,
    hd_element_steps,
    pieces,
    hd_all_gather_steps,
    hd_fold,
    hd_reduce_scatter_steps,
    largest_power_of_two,
)


Step = tuple[tuple[int, int], tuple[int, int], int]  # (range sent, range received, peer)


def _halving_gloo(comm: Comm, flat: torch.Tensor, scratch: torch.Tensor, op: str, halving: Sequence[Step],
                  sent: list, kept: list, after_first_receives: Callable[[], None] | None = None) -> None:
    """The halving steps on Gloo, in the posting order of the module docstring; ``after_first_receives``
    runs once the first step's receives are posted (the all-reduce posts its doubling receives there)."""
    pg, tag = comm.pg, comm.tag_of(0)
    piece = max(1, PIECE_BYTES // flat.element_size())
    for k, ((sa, sb), (ra, rb), peer) in enumerate(halving):
        sends = [flat[a:b] for a, b in pieces(sa, sb, piece)]
        if k == 0:  # both partners start together: sends first (ring.ring_pass)
            sent += [pg.send([t], peer, tag) for t in sends]
        arriving = pieces(ra, rb, piece)
        works = [pg.recv([scratch[a - ra : b - ra]], peer, tag) for a, b in arriving]
        kept += works  # every work is kept until the end, as the ring keeps its (ring.ring_pass)
        if k == 0:
            if after_first_receives is not None:
                after_first_receives()
        else:  # the peer's sends of this step find their receives posted
            sent += [pg.send([t], peer, tag) for t in sends]
        for (a, b), work in zip(arriving, works):
            work.wait()
            combine_(flat[a:b], scratch[a - ra : b - ra], op)


def _post_doubling_receives(comm: Comm, flat: torch.Tensor, doubling: Sequence[Step]) -> list:
    """Every doubling receive, straight into its place, on the collective's second tag."""
    pg, tag = comm.pg, comm.tag_of(1)
    return [pg.recv([flat[a:b]], q, tag) if b > a else None for _, (a, b), q in doubling]


def _doubling_gloo(comm: Comm, flat: torch.Tensor, doubling: Sequence[Step], gathered: list, sent: list,
                   first_sent: bool = False) -> None:
    """The doubling steps on Gloo, their receives ``gathered`` already posted; ``first_sent``: the
    first step's send is already out."""
    pg, tag = comm.pg, comm.tag_of(1)
    for k, (((sa, sb), _, peer), work) in enumerate(zip(doubling, gathered)):
        if sb > sa and not (k == 0 and first_sent):
            sent.append(pg.send([flat[sa:sb]], peer, tag))
        if work is not None:
            work.wait()  # the next step sends what this one received


def _steps_gloo(comm: Comm, flat: torch.Tensor, scratch: torch.Tensor, op: str,
                halving: list[Step], doubling: list[Step], owned: tuple[int, int]) -> None:
    """Halving then doubling on Gloo, in the posting order of the module docstring."""
    sent: list = []
    kept: list = []
    gathered: list = []

    def post_gathers() -> None:
        gathered.extend(_post_doubling_receives(comm, flat, doubling))

    _halving_gloo(comm, flat, scratch, op, halving, sent, kept, post_gathers)
    finish_(flat[owned[0] : owned[1]], op, comm.size)
    _doubling_gloo(comm, flat, doubling, gathered, sent)
    wait_all(sent)


def _steps_nccl(comm: Comm, flat: torch.Tensor, scratch: torch.Tensor, op: str,
                halving: list[Step], doubling: list[Step], owned: tuple[int, int]) -> None:
    """Halving then doubling on NCCL: each step one grouped exchange (NCCL pipelines inside it)."""
    sent: list = []
    for (sa, sb), (ra, rb), peer in halving:
        _exchange(comm, flat[sa:sb], scratch[: rb - ra], peer, sent)
        combine_(flat[ra:rb], scratch[: rb - ra], op)
    finish_(flat[owned[0] : owned[1]], op, comm.size)
    wait_all(sent)  # the doubling receives into the ranges the halving sent
    sent.clear()
    for (sa, sb), (ra, rb), peer in doubling:
        _exchange(comm, flat[sa:sb], flat[ra:rb], peer, sent)
    wait_all(sent)


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
    doubling = hd_all_gather_steps(virtual, p)
    # Reused across calls (p2p.Comm.scratch): half the largest message stays allocated.
    largest = max((span(s.recv)[1] - span(s.recv)[0] for s in halving), default=0)
    scratch = comm.scratch("halving_doubling", largest, flat)
    steps = _steps_nccl if comm.coalesce else _steps_gloo
    steps(comm, flat, scratch, op, [(span(s.send), span(s.recv), s.peer) for s in halving],
          [(span(s.send), span(s.recv), s.peer) for s in doubling], bounds[virtual])

    if role == "proxy":
        wait_all(comm.post(sends=[(flat, partner)])[1])


# --- the halves on their own: reduce-scatter and all-gather (power-of-two world sizes) ----------


def reduce_scatter_halving(flat: torch.Tensor, op: str, comm: Comm) -> None:
    """Recursive-halving reduce-scatter in place: rank r ends holding the reduced block r of
    ``chunk_bounds(numel, size)`` (the ring's block), other elements partial sums. log2 p steps,
    (p-1)/p n bytes sent per rank, as the ring's, in log2 p messages instead of p - 1 (Thakur et
    al. 2005, section 4.4's first half). ValueError unless the world size is a power of two."""
    p, n = comm.size, flat.numel()
    check_power_of_two(p)
    if p == 1 or n == 0:
        finish_(flat, op, p)
        return
    halving = hd_element_steps(n, p, comm.rank)
    scratch = comm.scratch("halving_doubling", max(rb - ra for _, (ra, rb), _ in halving), flat)
    sent: list = []
    kept: list = []  # the receives' works, kept until the end (ring.ring_pass says why)
    if comm.coalesce:
        for (sa, sb), (ra, rb), peer in halving:
            _exchange(comm, flat[sa:sb], scratch[: rb - ra], peer, sent)
            combine_(flat[ra:rb], scratch[: rb - ra], op)
    else:
        _halving_gloo(comm, flat, scratch, op, halving, sent, kept)
    lo, hi = chunk_bounds(n, p)[comm.rank]
    finish_(flat[lo:hi], op, p)
    wait_all(sent)


def all_gather_doubling(flat: torch.Tensor, comm: Comm) -> None:
    """Recursive-doubling all-gather in place: rank r contributes block r of ``chunk_bounds(numel,
    size)`` and every rank ends with every block; each step doubles the range a rank holds
    (the halving's ranges in reverse). ValueError unless the world size is a power of two."""
    p, n = comm.size, flat.numel()
    check_power_of_two(p)
    if p == 1 or n == 0:
        return
    doubling = hd_element_steps(n, p, comm.rank, all_gather=True)
    sent: list = []
    if comm.coalesce:
        for (sa, sb), (ra, rb), peer in doubling:
            _exchange(comm, flat[sa:sb], flat[ra:rb], peer, sent)
    else:
        (sa, sb), _, peer = doubling[0]
        if sb > sa:  # both partners start together: the first send before any receive (ring.ring_pass)
            sent.append(comm.pg.send([flat[sa:sb]], peer, comm.tag_of(1)))
        gathered = _post_doubling_receives(comm, flat, doubling)
        _doubling_gloo(comm, flat, doubling, gathered, sent, first_sent=True)
    wait_all(sent)
