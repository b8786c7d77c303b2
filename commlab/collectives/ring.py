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
At most ``WINDOW`` reduce-scatter receives are in flight, landing in ``WINDOW + 1`` scratch
slots reused round-robin; all-gather pieces land directly in place, so all of their receives
are posted at the start (on the collective's second tag, see :func:`ring_pass`).
"""

from __future__ import annotations

import torch

from commlab.collectives.p2p import PIECE_BYTES, Comm, wait_all
from commlab.collectives.reduce_ops import combine_, finish_
from commlab.collectives.schedules import (
    COPY,
    REDUCE_LAST,
    chunk_bounds,
    ring_neighbours,
    ring_plan,
    ring_steps,
)

# Reduce-scatter receives in flight at once. They land in WINDOW + 1 scratch slots reused
# round-robin: the spare slot lets the next receive be posted *before* the current piece is
# reduced, so the left neighbour's send finds it posted (see ring_pass).
WINDOW = 4


def ring_pass(
    flat: torch.Tensor, op: str, comm: Comm, *, reduce_scatter: bool, all_gather: bool,
    piece_bytes: int | None = None,
) -> None:
    """Run the ring's reduce-scatter and/or all-gather steps on a flat contiguous tensor.

    Posting order (Gloo's TCP pair, gloo/transport/tcp/pair.cc): a send whose receive the peer
    has already posted is written to the socket at once *by the sending thread*; a send posted
    first only announces itself and is written by Gloo's event-loop thread once the peer's
    receive arrives. Hence:

    - step 0's sends go first, before any receive: both ranks of a pair start at once, and a
      send that finds its receive posted would block this thread for the whole write (~0.5 ms
      per 2 MiB here) before it can post its own receives or reduce anything;
    - then the first WINDOW reduce-scatter receives and every all-gather receive (they land in
      place, on their own tag ``comm.tag_of(1)``: Gloo matches a pair's receives of one tag in
      posting order, and the reduce-scatter ones are posted a window at a time);
    - in the loop, the next reduce-scatter receive is posted before the reduction, into the
      spare slot, so the forwarded piece the left neighbour sends next finds it posted.

    The index maths is :func:`~commlab.collectives.schedules.ring_plan`, cached per size; the
    loop calls the group's own send/recv (no per-piece closures or ``Comm.post``).

    Measured (world 2, 4-64 MB, the variants and native called in a shuffled order in one run,
    120 calls per size, median ratio to native): the previous version (receives before step 0's
    sends, the plan rebuilt per call) 1.39/1.21/1.07/1.07/1.00, geomean 1.14; the cached plan
    with receives first 1.24/1.03/1.05/1.07/1.01 (1.08); with step 0's sends first
    1.17/0.95/1.03/1.05/1.00 (1.04). World 4, 40 calls: 1.04, 1.03, 1.04 (no clear change).
    ``commlab bench collectives`` gives the figures that count (README).
    Per message the p2p path costs ~80 us of CPU more than Gloo's C++ ring, which is why the
    pieces are 2 MiB and not Gloo's 1 MiB (:data:`~commlab.collectives.p2p.PIECE_BYTES`).

    Every work object is kept until the pass ends. Dropping each receive's work as soon as it was
    waited for (the previous version) cost the process 0.1-1.2 ms more CPU per 4 MB all-reduce
    at world 2 (``time.process_time``, median of 100-150 calls, three runs, the same messages
    posted in the same order) and its median time over native went 1.46/1.18/1.23 -> 1.26/1.02/1.05.
    """
    p, r = comm.size, comm.rank
    if comm.coalesce:
        _ring_pass_stepwise(flat, op, comm, reduce_scatter, all_gather)
        return
    piece_numel = max(1, (PIECE_BYTES if piece_bytes is None else piece_bytes) // flat.element_size())
    plan = ring_plan(flat.numel(), p, r, piece_numel, reduce_scatter, all_gather)
    if not plan.arrivals and not plan.first_sends:  # with fewer elements than ranks a rank may only send
        return
    left, right = ring_neighbours(r, p)
    tags = (comm.tag_of(0), comm.tag_of(1))
    pg = comm.pg
    # Step 0's sends go first (see above), before the rest is even prepared.
    sent = [pg.send([flat[a:b]], right, tags[plan.first_phase]) for a, b in plan.first_sends]
    arrivals, n_reduce, n = plan.arrivals, plan.n_reduce, len(plan.arrivals)
    window = min(WINDOW, n_reduce)
    slots = window + 1 if n_reduce > window else window
    slot = plan.slot_numel
    scratch = comm.scratch("ring", slots * slot, flat) if n_reduce else None
    landing = [
        scratch[(q % slots) * slot :][: x.stop - x.start] if q < n_reduce else flat[x.start : x.stop]
        for q, x in enumerate(arrivals)
    ]
    pending: list = [None] * n
    for q in [*range(window), *range(n_reduce, n)]:
        pending[q] = pg.recv([landing[q]], left, tags[arrivals[q].phase])
    for q, piece in enumerate(arrivals):
        pending[q].wait()  # the work is kept until the end: see the docstring
        if q + window < n_reduce:  # into the spare slot, freed by the piece before this one
            pending[q + window] = pg.recv([landing[q + window]], left, tags[0])
        if piece.kind == COPY:
            view = landing[q]
        else:
            view = flat[piece.start : piece.stop]
            combine_(view, landing[q], op)
            if piece.kind == REDUCE_LAST:
                finish_(view, op, p)
        if piece.forward is not None:  # the block received at step s is the one sent at step s+1
            sent.append(pg.send([view], right, tags[piece.forward]))
    wait_all(sent)


def _ring_pass_stepwise(flat: torch.Tensor, op: str, comm: Comm, reduce_scatter: bool, all_gather: bool) -> None:
    """The same steps with each step's send and receive in one NCCL group call.

    NCCL pipelines a message in its own chunks; pairing each send with its receive in a batch is
    what keeps a ring of NCCL p2p calls from deadlocking, so nothing is split further here.
    """
    steps = ring_steps(comm.rank, comm.size, reduce_scatter, all_gather)
    if not steps or flat.numel() == 0:
        return
    left, right = ring_neighbours(comm.rank, comm.size)
    bounds = chunk_bounds(flat.numel(), comm.size)
    scratch = comm.scratch("ring", max(b - a for a, b in bounds), flat)
    for send_block, recv_block, kind in steps:
        (sa, sb), (ra, rb) = bounds[send_block], bounds[recv_block]
        landing = flat[ra:rb] if kind == COPY else scratch[: rb - ra]
        wait_all(comm.post(sends=[(flat[sa:sb], right)], recvs=[(landing, left)])[0])
        if kind != COPY:
            combine_(flat[ra:rb], landing, op)
            if kind == REDUCE_LAST:
                finish_(flat[ra:rb], op, comm.size)


def all_reduce_ring(flat: torch.Tensor, op: str, comm: Comm, *, piece_bytes: int | None = None) -> None:
    ring_pass(flat, op, comm, reduce_scatter=True, all_gather=True, piece_bytes=piece_bytes)


def reduce_scatter_ring(flat: torch.Tensor, op: str, comm: Comm, *, piece_bytes: int | None = None) -> None:
    ring_pass(flat, op, comm, reduce_scatter=True, all_gather=False, piece_bytes=piece_bytes)


def all_gather_ring(flat: torch.Tensor, comm: Comm, *, piece_bytes: int | None = None) -> None:
    ring_pass(flat, "sum", comm, reduce_scatter=False, all_gather=True, piece_bytes=piece_bytes)
