"""Ring all-reduce = ring reduce-scatter + ring all-gather, pipelined in pieces.

Step structure (Patarasuk & Yuan, "Bandwidth optimal all-reduce algorithms for clusters of
workstations", JPDC 2009; the schedule of NCCL's ring and of Horovod): the vector is cut into p
blocks. In each of p-1 reduce-scatter steps every rank sends one block to its right neighbour
and reduces the block arriving from its left neighbour into its own copy; rank r then holds the
reduced block r. In p-1 all-gather steps the reduced blocks travel once more around the ring.

Pipelining: each block is cut into pieces of ``piece_bytes``. A piece is forwarded (sent at the
next step) as soon as it has arrived and been reduced, so on large messages sending piece j+1,
receiving piece j+1 and reducing piece j overlap, across step boundaries too: the whole
all-reduce is one pass of 2(p-1) steps in which the first p-1 reduce and the rest copy.
Received reduce-scatter pieces land in a double-buffered scratch block (step s and s+1 are in
flight together); all-gather pieces land directly in place.
"""

from __future__ import annotations

import torch

from commlab.collectives.p2p import Comm, wait_all
from commlab.collectives.reduce_ops import combine_, finish_
from commlab.collectives.schedules import (
    chunk_bounds,
    pieces,
    ring_all_gather_blocks,
    ring_neighbours,
    ring_reduce_scatter_blocks,
)

# Chosen by `commlab bench collectives` on Gloo/CPU: large enough that Python's per-message cost
# (~tens of us) is small against the transfer, small enough to overlap several pieces per block.
PIECE_BYTES = 1 << 20

_REDUCE, _REDUCE_LAST, _COPY = "reduce", "reduce_last", "copy"


def ring_pass(
    flat: torch.Tensor, op: str, comm: Comm, *, reduce_scatter: bool, all_gather: bool,
    piece_bytes: int = PIECE_BYTES,
) -> None:
    """Run the ring's reduce-scatter and/or all-gather steps on a flat contiguous tensor."""
    p, r = comm.size, comm.rank
    steps = []
    if reduce_scatter:
        rs = ring_reduce_scatter_blocks(r, p)
        steps += [(s, rv, _REDUCE_LAST if i == len(rs) - 1 else _REDUCE) for i, (s, rv) in enumerate(rs)]
    if all_gather:
        steps += [(s, rv, _COPY) for s, rv in ring_all_gather_blocks(r, p)]
    if not steps or flat.numel() == 0:
        return
    left, right = ring_neighbours(r, p)
    bounds = chunk_bounds(flat.numel(), p)
    piece_numel = max(1, piece_bytes // flat.element_size())
    width = max(b - a for a, b in bounds)
    scratch = [flat.new_empty(width) for _ in range(2)] if reduce_scatter else []
    sent: list = []

    def cut(block: int) -> list[tuple[int, int]]:
        return pieces(*bounds[block], piece_numel)

    def landing(s: int, a: int, b: int) -> torch.Tensor:
        """Where piece [a, b) of step s's received block arrives: scratch when reducing."""
        if steps[s][2] == _COPY:
            return flat[a:b]
        start = bounds[steps[s][1]][0]
        return scratch[s % 2][a - start : b - start]

    def post(s: int, send, recv) -> list:
        sends = [(flat[send[0] : send[1]], right)] if send else []
        recvs = [(landing(s, *recv), left)] if recv else []
        recv_works, send_works = comm.post(sends, recvs)
        sent.extend(send_works)
        return recv_works

    first_send, first_recv = cut(steps[0][0]), cut(steps[0][1])
    pending = [
        post(0, first_send[j] if j < len(first_send) else None, first_recv[j] if j < len(first_recv) else None)
        for j in range(max(len(first_send), len(first_recv)))
    ]
    for s, (_, recv_block, mode) in enumerate(steps):
        got = cut(recv_block)
        later = cut(steps[s + 1][1]) if s + 1 < len(steps) else None
        following = []
        for j, (a, b) in enumerate(got):
            wait_all(pending[j])
            if mode != _COPY:
                combine_(flat[a:b], landing(s, a, b), op)
                if mode == _REDUCE_LAST:
                    finish_(flat[a:b], op, p)
            if later is not None:  # the block just received is the one sent at step s+1
                following.append(post(s + 1, (a, b), later[j] if j < len(later) else None))
        if later is not None:
            # Blocks differ by at most one element, so the next one may have one more piece.
            following += [post(s + 1, None, piece) for piece in later[len(got) :]]
        pending = following
    wait_all(sent)


def all_reduce_ring(flat: torch.Tensor, op: str, comm: Comm, *, piece_bytes: int = PIECE_BYTES) -> None:
    ring_pass(flat, op, comm, reduce_scatter=True, all_gather=True, piece_bytes=piece_bytes)


def reduce_scatter_ring(flat: torch.Tensor, op: str, comm: Comm, *, piece_bytes: int = PIECE_BYTES) -> None:
    ring_pass(flat, op, comm, reduce_scatter=True, all_gather=False, piece_bytes=piece_bytes)


def all_gather_ring(flat: torch.Tensor, comm: Comm, *, piece_bytes: int = PIECE_BYTES) -> None:
    ring_pass(flat, "sum", comm, reduce_scatter=False, all_gather=True, piece_bytes=piece_bytes)
