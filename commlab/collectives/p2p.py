"""Point-to-point plumbing: group ranks to global ranks, and posting one step's sends/receives.

The algorithms speak in *group* ranks. torch's ``isend``/``irecv`` take the peer as a *global*
rank (``group_dst``/``group_src`` exist only from torch 2.6), so :class:`Comm` resolves the
group's global ranks once per collective with ``dist.get_process_group_ranks``.

On NCCL one step's sends and receives go through ``batch_isend_irecv``, which fuses them into
one NCCL group call: posting a ring's send and receive as separate NCCL calls can deadlock
(each rank's send waits for a receive that is queued behind it). Gloo cannot coalesce, and
``batch_isend_irecv`` would only loop over the same ``isend``/``irecv`` calls, so on Gloo they
are posted directly. Empty slices are skipped on both sides (both sides know every size).

Every message of one collective carries that collective's tag (the group worker's sequence
number), so a message a failed collective left in flight is never matched by a later one
(Gloo matches on tag; NCCL ignores tags, and a failed NCCL communicator must be replaced anyway).

A collective may use up to :data:`TAG_PHASES` tags, ``comm.tag_of(k)`` (the ring receives its
all-gather pieces on a second tag so that it can post them all before the reduce-scatter's,
which Gloo would otherwise match in posting order): the group worker's tags stay below
:data:`TAG_SPAN` and phase k adds k * TAG_SPAN, which keeps every tag a non-negative int32.

Scratch: received pieces that are reduced (not received in place) land in buffers from
:meth:`Comm.scratch`, kept per (group, use, dtype, device) and reused by every later collective
of the group. A fresh buffer per call costs more than its allocation: the CPU allocator hands
large blocks straight back to the system, so each call page-faults its scratch in again (a
fresh 8 MiB is ~2,000 minor faults). A group's collectives run one at a time (its worker, see
worker.py), so one buffer per use per group is never shared by two running collectives.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch
import torch.distributed as dist

# The piece the ring and halving-doubling cut long Gloo messages into. It should fit the sending
# socket's buffer: Gloo writes a send whose receive is posted on the posting thread only as far
# as the socket takes it, and hands the rest to its event-loop thread, which also reads every
# incoming piece (gloo/transport/tcp/pair.cc, sendAsyncMode). Loopback's send buffer autotunes to
# at most 4 MiB here (tcp_wmem); 2 MiB pieces ran at native's time where whole blocks of up to
# 16 MiB ran 2-12% over it (docs/design.md, "Why this order and this size on Gloo";
# docs/measurements.md, 2026-11-25).
PIECE_BYTES = 2 << 20
TAG_SPAN = 1 << 30  # the worker's tags are 1 .. TAG_SPAN - 1
TAG_PHASES = 2

# (group, use, dtype, device) -> a 1-D buffer, grown to the largest request seen and kept.
_SCRATCH: dict[tuple, torch.Tensor] = {}
_SCRATCH_LOCK = threading.Lock()  # only the table: each buffer is used by one group's worker
# group -> its Comm with tag 0: a group's ranks, size and backend never change, and asking torch
# for them again on every collective cost ~5 us warm and far more on the cold path right after a
# barrier (docs/measurements.md, 2026-11-25: the path before the first send).
_GROUP_COMMS: dict[dist.ProcessGroup, Comm] = {}


def release_group_state(groups) -> None:
    """Drop the scratch buffers and cached facts of ``groups`` (their DDP or process group is gone)."""
    gone = set(groups)
    with _SCRATCH_LOCK:
        for key in [k for k in _SCRATCH if k[0] in gone]:
            del _SCRATCH[key]
        for pg in gone & _GROUP_COMMS.keys():
            del _GROUP_COMMS[pg]


@dataclass(frozen=True)
class Comm:
    """One collective's view of its group: my group rank, the size, the global rank of each."""

    group: dist.ProcessGroup | None
    rank: int
    size: int
    global_ranks: tuple[int, ...]
    coalesce: bool  # True on NCCL: post each step as one batch
    pg: dist.ProcessGroup  # the group object itself (the world group for None)
    tag: int = 0  # every message of this collective carries it

    @classmethod
    def of(cls, group: dist.ProcessGroup | None, tag: int = 0) -> Comm:
        """The group's view for the collective tagged ``tag`` (the group's facts are asked once)."""
        pg = dist.group.WORLD if group is None else group
        base = _GROUP_COMMS.get(pg)
        if base is None:
            base = _GROUP_COMMS[pg] = cls._ask_torch(group, pg)
        return base if tag == base.tag else cls(group, base.rank, base.size, base.global_ranks, base.coalesce, pg, tag)

    @classmethod
    def _ask_torch(cls, group: dist.ProcessGroup | None, pg: dist.ProcessGroup) -> Comm:
        size = dist.get_world_size(group)
        ranks = tuple(range(size)) if group is None else tuple(dist.get_process_group_ranks(group))
        nccl = str(dist.get_backend(group)).lower() == "nccl"
        return cls(group, dist.get_rank(group), size, ranks, nccl, pg, 0)

    def tag_of(self, phase: int) -> int:
        """This collective's tag for its message stream ``phase`` (0 is ``tag`` itself)."""
        if not 0 <= phase < TAG_PHASES:
            raise ValueError(f"phase must be in [0, {TAG_PHASES}), got {phase}")
        return self.tag + phase * TAG_SPAN

    def scratch(self, use: str, numel: int, like: torch.Tensor) -> torch.Tensor:
        """A flat buffer of ``numel`` elements of ``like``'s dtype and device, reused across this
        group's collectives: only the caller's ``use`` (e.g. "ring") of this group touches it."""
        key = (self.pg, use, like.dtype, like.device)
        with _SCRATCH_LOCK:
            buffer = _SCRATCH.get(key)
            if buffer is None or buffer.numel() < numel:
                buffer = _SCRATCH[key] = torch.empty(numel, dtype=like.dtype, device=like.device)
        return buffer[:numel]

    def post(
        self,
        sends: list[tuple[torch.Tensor, int]] = (),
        recvs: list[tuple[torch.Tensor, int]] = (),
    ) -> tuple[list[dist.Work], list[dist.Work]]:
        """Start sending each (tensor, group peer) in ``sends`` and receiving into ``recvs``.

        Returns (works to wait on before reading the received data, works to wait on before
        reusing the sent buffers). A coalesced NCCL batch is one work and appears in both.
        """
        recvs = [(t, p) for t, p in recvs if t.numel() > 0]
        sends = [(t, p) for t, p in sends if t.numel() > 0]
        if self.coalesce and (recvs or sends):
            ops = [dist.P2POp(dist.irecv, t, self.global_ranks[p], self.group, self.tag) for t, p in recvs]
            ops += [dist.P2POp(dist.isend, t, self.global_ranks[p], self.group, self.tag) for t, p in sends]
            works = list(dist.batch_isend_irecv(ops))
            return works, works
        # The group's own send/recv take group ranks; they are what dist.isend/irecv end in, minus
        # ~10 us a call of argument checks and rank translation (a ring posts ~100 per 64 MB).
        recv_works = [self.pg.recv([t], p, self.tag) for t, p in recvs]
        send_works = [self.pg.send([t], p, self.tag) for t, p in sends]
        return recv_works, send_works


def wait_all(works: list[dist.Work]) -> None:
    """Wait for every work; each wait is bounded by the process group's timeout."""
    for w in works:
        w.wait()
