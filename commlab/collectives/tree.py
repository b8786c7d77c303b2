"""Binary-tree reduce and broadcast, pipelined in pieces, and the tree all-reduce built on them.

The tree is heap-ordered over ranks relabelled so that the root is 0 (children of v are 2v+1 and
2v+2), so its depth is floor(log2 p). ``reduce``: every rank waits for its children's piece,
combines it into its own, and passes the piece to its parent. ``broadcast``: every rank receives
a piece from its parent and passes it to its children. Pieces flow down (or up) the tree one
behind another, so with k pieces a reduce costs about (depth + k - 1) piece-hops instead of
depth x message: the pipelined tree of NCCL's tree algorithm and of MPICH's long-message
broadcast. For small messages (one piece) a tree all-reduce is 2 x depth hops against the ring's
2(p-1), which is why it wins on latency.

The all-reduce is a reduce to rank 0 followed by a broadcast from it; the two phases are not
overlapped with each other (a rank's buffer is still being sent up while the result would come
down into it), which costs one extra depth of latency on large messages.
"""

from __future__ import annotations

import torch

from commlab.collectives.p2p import Comm, wait_all
from commlab.collectives.reduce_ops import combine_, finish_
from commlab.collectives.schedules import pieces, tree_children, tree_parent

PIECE_BYTES = 1 << 20
# Receives in flight per child during a reduce: bounds the scratch to WINDOW pieces per child.
WINDOW = 4


def reduce_tree(
    flat: torch.Tensor, op: str, comm: Comm, root: int = 0, *, piece_bytes: int = PIECE_BYTES
) -> None:
    """Reduce ``flat`` onto group rank ``root``; other ranks' buffers end holding partial sums."""
    n = flat.numel()
    if comm.size == 1 or n == 0:
        finish_(flat, op, comm.size)
        return
    parent = tree_parent(comm.rank, comm.size, root)
    children = tree_children(comm.rank, comm.size, root)
    piece_numel = max(1, piece_bytes // flat.element_size())
    cuts = pieces(0, n, piece_numel)
    slots = min(WINDOW, len(cuts))
    # One spare slot per child, so the next receive is posted before this piece is reduced (as
    # the ring does, see ring.ring_pass: a send that finds its receive posted is written at once).
    buffers = slots + 1 if len(cuts) > slots else slots
    size = buffers * piece_numel if len(cuts) > 1 else n
    scratch = {c: comm.scratch(f"tree-child-{k}", size, flat) for k, c in enumerate(children)}

    def landing(child: int, j: int) -> torch.Tensor:
        a, b = cuts[j]
        offset = (j % buffers) * piece_numel
        return scratch[child][offset : offset + (b - a)]

    def post_recv(j: int) -> list:
        return comm.post(recvs=[(landing(c, j), c) for c in children])[0]

    pending = {j: post_recv(j) for j in range(slots)}
    sent: list = []
    for j, (a, b) in enumerate(cuts):
        wait_all(pending[j])  # kept until the end, as the ring keeps its works (ring.ring_pass)
        if j + slots < len(cuts):  # into the spare slot, freed by piece j - 1
            pending[j + slots] = post_recv(j + slots)
        for c in children:
            combine_(flat[a:b], landing(c, j), op)
        if parent is None:
            finish_(flat[a:b], op, comm.size)
        else:
            sent += comm.post(sends=[(flat[a:b], parent)])[1]
    wait_all(sent)


def broadcast_tree(flat: torch.Tensor, comm: Comm, root: int = 0, *, piece_bytes: int = PIECE_BYTES) -> None:
    """Copy group rank ``root``'s ``flat`` to every rank of the group."""
    n = flat.numel()
    if comm.size == 1 or n == 0:
        return
    parent = tree_parent(comm.rank, comm.size, root)
    children = tree_children(comm.rank, comm.size, root)
    cuts = pieces(0, n, max(1, piece_bytes // flat.element_size()))
    # Pieces arrive in place, so every receive can be posted at once.
    arriving = [comm.post(recvs=[(flat[a:b], parent)])[0] for a, b in cuts] if parent is not None else None
    sent: list = []
    for j, (a, b) in enumerate(cuts):
        if arriving is not None:
            wait_all(arriving[j])
        sent += comm.post(sends=[(flat[a:b], c) for c in children])[1]
    wait_all(sent)


def all_reduce_tree(flat: torch.Tensor, op: str, comm: Comm, *, piece_bytes: int = PIECE_BYTES) -> None:
    reduce_tree(flat, op, comm, 0, piece_bytes=piece_bytes)
    broadcast_tree(flat, comm, 0, piece_bytes=piece_bytes)
