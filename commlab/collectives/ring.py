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
At most ``WINDOW`` receives are in flight; reduce-scatter pieces land in that many scratch
slots (reused round-robin), all-gather pieces land directly in place.
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

# Measured on Gloo/CPU (2 cores, world 2 and 4, 4-64 MB, interleaved with native): 256 KiB
# pieces cost 1.6-2.7x native (Python and a thread wake-up per message), whole blocks 1.5-2.4x
# (no overlap, fresh scratch pages), 1 MiB 1.0-2.0x, 2 MiB with a window of 4 1.05-1.3x.
PIECE_BYTES = 2 << 20
# Receives in flight at once; received reduce-scatter pieces land in this many scratch slots,
# so the scratch stays small and cache-warm instead of a whole block of fresh pages.
WINDOW = 4

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
    if comm.coalesce:
        _ring_pass_stepwise(flat, op, comm, steps, bounds)
        return
    piece_numel = max(1, piece_bytes // flat.element_size())
    # Every piece this rank receives, in the order the left neighbour sends them: step by step,
    # piece by piece. Pieces are cut relative to their block, so the block received at step s
    # is cut exactly as it is sent on at step s+1.
    arrivals = [(s, j, a, b) for s, (_, block, _) in enumerate(steps) for j, (a, b) in enumerate(pieces(*bounds[block], piece_numel))]
    slots = min(WINDOW, len(arrivals))
    scratch = comm.scratch("ring", slots * piece_numel, flat) if reduce_scatter else None
    sent: list = []

    def landing(q: int) -> torch.Tensor:
        s, _, a, b = arrivals[q]
        if steps[s][2] == _COPY:
            return flat[a:b]
        offset = (q % slots) * piece_numel
        return scratch[offset : offset + (b - a)]

    def send(a: int, b: int) -> None:
        sent.extend(comm.post(sends=[(flat[a:b], right)])[1])

    def receive(q: int) -> list:
        return comm.post(recvs=[(landing(q), left)])[0]

    for a, b in pieces(*bounds[steps[0][0]], piece_numel):  # step 0 sends data already here
        send(a, b)
    pending = {q: receive(q) for q in range(slots)}
    for q, (s, _, a, b) in enumerate(arrivals):
        wait_all(pending.pop(q))
        mode = steps[s][2]
        if mode != _COPY:
            combine_(flat[a:b], landing(q), op)
            if mode == _REDUCE_LAST:
                finish_(flat[a:b], op, p)
        if q + slots < len(arrivals):  # this piece's scratch slot is free again
            pending[q + slots] = receive(q + slots)
        if s + 1 < len(steps):  # the block received at step s is the one sent at step s+1
            send(a, b)
    wait_all(sent)


def _ring_pass_stepwise(flat: torch.Tensor, op: str, comm: Comm, steps: list, bounds: list) -> None:
    """The same steps with each step's send and receive in one NCCL group call.

    NCCL pipelines a message in its own chunks; pairing each send with its receive in a batch is
    what keeps a ring of NCCL p2p calls from deadlocking, so nothing is split further here.
    """
    left, right = ring_neighbours(comm.rank, comm.size)
    scratch = comm.scratch("ring", max(b - a for a, b in bounds), flat)
    for send_block, recv_block, mode in steps:
        (sa, sb), (ra, rb) = bounds[send_block], bounds[recv_block]
        landing = flat[ra:rb] if mode == _COPY else scratch[: rb - ra]
        wait_all(comm.post(sends=[(flat[sa:sb], right)], recvs=[(landing, left)])[0])
        if mode != _COPY:
            combine_(flat[ra:rb], landing, op)
            if mode == _REDUCE_LAST:
                finish_(flat[ra:rb], op, comm.size)


def all_reduce_ring(flat: torch.Tensor, op: str, comm: Comm, *, piece_bytes: int = PIECE_BYTES) -> None:
    ring_pass(flat, op, comm, reduce_scatter=True, all_gather=True, piece_bytes=piece_bytes)


def reduce_scatter_ring(flat: torch.Tensor, op: str, comm: Comm, *, piece_bytes: int = PIECE_BYTES) -> None:
    ring_pass(flat, op, comm, reduce_scatter=True, all_gather=False, piece_bytes=piece_bytes)


def all_gather_ring(flat: torch.Tensor, comm: Comm, *, piece_bytes: int = PIECE_BYTES) -> None:
    ring_pass(flat, "sum", comm, reduce_scatter=False, all_gather=True, piece_bytes=piece_bytes)
