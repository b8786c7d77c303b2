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
# Reduce-scatter receives in flight at once. They land in WINDOW + 1 scratch slots reused
# round-robin: the spare slot lets the next receive be posted *before* the current piece is
# reduced, so the left neighbour's send finds it posted (see ring_pass).
WINDOW = 4

_REDUCE, _REDUCE_LAST, _COPY = "reduce", "reduce_last", "copy"


def ring_pass(
    flat: torch.Tensor, op: str, comm: Comm, *, reduce_scatter: bool, all_gather: bool,
    piece_bytes: int = PIECE_BYTES,
) -> None:
    """Run the ring's reduce-scatter and/or all-gather steps on a flat contiguous tensor.

    Why receives are posted as early as they are (Gloo's TCP pair, gloo/transport/tcp/pair.cc):
    a send whose receive the peer has already posted is written to the socket at once by the
    sending thread; a send posted first only announces itself (NOTIFY_SEND_READY) and is written
    later by the *peer's receive notification* on Gloo's single event-loop thread, which is also
    the thread reading every incoming piece. So a late receive costs a round trip and moves the
    sender's copy onto the busy loop thread. Hence: all-gather pieces, which land in place, are
    all received from the start on their own tag (``comm.tag_of(1)``: Gloo matches a pair's
    receives of one tag in posting order, and the reduce-scatter ones are posted a window at a
    time); the next reduce-scatter receive is posted before the reduction, not after it.
    The loop runs on precomputed views (no per-piece closures or lists) and calls the group's
    own send/recv directly (no ``Comm.post`` per piece).

    Measured against the previous version (receives posted after the reduction, all-gather
    receives a window at a time, ``Comm.post`` per piece), both alternating with native in one
    run, 2-core machine under other jobs' load (load average 6-9), mean over ranks of CPU time
    per call (user + system, all threads; less load-sensitive than wall time), old -> new
    (native): world 4, 4/8/16/32/64 MB: 6.4/10.6/20.8/36.3/72.4 -> 5.2/9.3/18.6/31.7/66.8 ms
    (4.4/8.4/17.5/30.1/61.8), time ratio to native geomean 1.21 -> 1.10; world 2, 64 MB
    45.8 -> 42.9 ms (41.5), 43.7 -> 41.0 (38.1) in a second run, geomean 1.13 -> 1.10 and
    1.27 -> 1.21. Per message the p2p path costs ~80 us of CPU more than Gloo's C++ ring (1 MiB
    pieces, or splitting small blocks into 2-4 pieces, raised CPU and time at 4-16 MB), and
    4 MiB pieces changed the 32-64 MB CPU by -2..-5% but the time by +-10%: not adopted.
    Posting every reduce-scatter receive up front (scratch of (p-1)/p of the message) matched the
    window of 4 in one run at load 5 (geomean 1.064 vs 1.056 at world 4, 1.127 vs 1.129 at 2).
    Command: ``commlab bench collectives -b 4M -e 64M -f 2 -n 10 --algorithm ring,native
    --world-size 2,4 --repeat 5`` (ratios), CPU from ``getrusage`` around each call.
    """
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
    # is cut exactly as it is sent on at step s+1. Reducing steps come first.
    arrivals = [(s, a, b) for s, (_, block, _) in enumerate(steps) for a, b in pieces(*bounds[block], piece_numel)]
    n, n_reduce = len(arrivals), sum(1 for s, _, _ in arrivals if steps[s][2] != _COPY)
    window = min(WINDOW, n_reduce)
    slots = window + 1 if n_reduce > window else window
    scratch = comm.scratch("ring", slots * piece_numel, flat) if n_reduce else None
    views = [flat[a:b] for _, a, b in arrivals]
    landing = [scratch[(q % slots) * piece_numel :][: b - a] if q < n_reduce else views[q] for q, (_, a, b) in enumerate(arrivals)]
    tags = [comm.tag_of(1 if mode == _COPY else 0) for _, _, mode in steps]  # per step
    pg, sent = comm.pg, []
    pending: list = [None] * n
    for q in [*range(window), *range(n_reduce, n)]:  # receives first: see the docstring
        pending[q] = pg.recv([landing[q]], left, tags[arrivals[q][0]])
    for a, b in pieces(*bounds[steps[0][0]], piece_numel):  # step 0 sends data already here
        sent.append(pg.send([flat[a:b]], right, tags[0]))
    last = len(steps) - 1
    for q, (s, _, _) in enumerate(arrivals):
        pending[q].wait()
        pending[q] = None
        if q + window < n_reduce:  # into the spare slot, freed by the piece before this one
            pending[q + window] = pg.recv([landing[q + window]], left, tags[arrivals[q + window][0]])
        mode = steps[s][2]
        if mode != _COPY:
            combine_(views[q], landing[q], op)
            if mode == _REDUCE_LAST:
                finish_(views[q], op, p)
        if s < last:  # the block received at step s is the one sent at step s+1
            sent.append(pg.send([views[q]], right, tags[s + 1]))
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
