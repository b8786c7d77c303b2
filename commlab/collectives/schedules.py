"""Index maths of the algorithms: who talks to whom at each step, and which slice they exchange.

Everything here is a pure function of (rank, world size, numel), so the step structure of every
algorithm can be read and tested without a single process. Ranks are *group* ranks; the
communication code maps them to global ranks. A "block" is one of the balanced slices of
:func:`chunk_bounds`; slices may be empty when there are fewer elements than blocks.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache


def chunk_bounds(numel: int, parts: int) -> list[tuple[int, int]]:
    """Split ``range(numel)`` into ``parts`` contiguous slices whose sizes differ by at most one.

    The first ``numel % parts`` slices get the extra element (as ``torch.tensor_split`` does), so
    any numel works for any number of parts, including numel 0 and numel < parts.
    """
    if parts < 1 or numel < 0:
        raise ValueError(f"need parts >= 1 and numel >= 0, got parts={parts}, numel={numel}")
    base, extra = divmod(numel, parts)
    bounds, start = [], 0
    for i in range(parts):
        stop = start + base + (1 if i < extra else 0)
        bounds.append((start, stop))
        start = stop
    return bounds


def pieces(start: int, stop: int, piece_numel: int) -> list[tuple[int, int]]:
    """Cut ``[start, stop)`` into pieces of at most ``piece_numel`` elements (none if empty)."""
    if piece_numel < 1:
        raise ValueError(f"piece_numel must be >= 1, got {piece_numel}")
    return [(s, min(s + piece_numel, stop)) for s in range(start, stop, piece_numel)]


# --- ring (Patarasuk & Yuan 2009; the bandwidth-optimal schedule NCCL's ring follows) ---------


def ring_neighbours(rank: int, world: int) -> tuple[int, int]:
    """(left, right): receive from the left, send to the right."""
    return (rank - 1) % world, (rank + 1) % world


def ring_reduce_scatter_blocks(rank: int, world: int) -> list[tuple[int, int]]:
    """Per step s = 0..world-2: (block sent to the right, block received from the left).

    The received block is reduced into the local one and sent on at the next step. The schedule
    is shifted so that rank r ends holding the fully reduced block r (as ``reduce_scatter``
    promises): the last block received is ``(r - world) % world == r``.
    """
    return [((rank - s - 1) % world, (rank - s - 2) % world) for s in range(world - 1)]


def ring_all_gather_blocks(rank: int, world: int) -> list[tuple[int, int]]:
    """Per step s = 0..world-2: (block sent, block received); rank r starts owning block r."""
    return [((rank - s) % world, (rank - s - 1) % world) for s in range(world - 1)]


REDUCE, REDUCE_LAST, COPY = 0, 1, 2  # what a ring piece's arrival does: reduce, reduce + finish, land


@dataclass(frozen=True)
class RingPiece:
    """One piece a rank receives in a ring pass, in arrival order: elements [start, stop) of the
    flat vector, what to do with it, the tag phase it arrives on and the one it is forwarded on
    (None: the last step's piece, kept)."""

    start: int
    stop: int
    kind: int  # REDUCE, REDUCE_LAST or COPY
    phase: int  # 0 reduce-scatter, 1 all-gather (see commlab.collectives.p2p.Comm.tag_of)
    forward: int | None


@dataclass(frozen=True)
class RingPlan:
    """A rank's whole ring pass: step 0's pieces (sent first, data already here, on tag phase
    ``first_phase``) and every arrival. The first ``n_reduce`` arrivals are reduced and land in
    scratch slots of ``slot_numel`` elements (the largest of them: a piece may be cut larger than
    the blocks, and the scratch is no larger than what lands in it)."""

    first_sends: tuple[tuple[int, int], ...]
    first_phase: int
    arrivals: tuple[RingPiece, ...]
    n_reduce: int
    slot_numel: int


def ring_steps(rank: int, world: int, reduce_scatter: bool, all_gather: bool) -> list[tuple[int, int, int]]:
    """A ring pass's steps in order: (block sent, block received, what the arrival does)."""
    steps = []
    if reduce_scatter:
        rs = ring_reduce_scatter_blocks(rank, world)
        steps += [(sent, got, REDUCE_LAST if i == len(rs) - 1 else REDUCE) for i, (sent, got) in enumerate(rs)]
    if all_gather:
        steps += [(sent, got, COPY) for sent, got in ring_all_gather_blocks(rank, world)]
    return steps


@lru_cache(maxsize=256)
def ring_plan(numel: int, world: int, rank: int, piece_numel: int, reduce_scatter: bool, all_gather: bool) -> RingPlan:
    """The ring pass of ``rank``, pieces cut relative to their block so that the block received
    at step s is cut exactly as it is sent on at step s+1. Cached: a DDP run repeats a few sizes,
    and rebuilding this per call cost ~0.1 ms, 3% of a 4 MB all-reduce at world 2."""
    steps = ring_steps(rank, world, reduce_scatter, all_gather)
    if not steps or numel == 0:
        return RingPlan((), 0, (), 0, 0)
    bounds = chunk_bounds(numel, world)
    phase = [1 if kind == COPY else 0 for _, _, kind in steps]
    arrivals = tuple(
        RingPiece(a, b, kind, phase[s], phase[s + 1] if s + 1 < len(steps) else None)
        for s, (_, got, kind) in enumerate(steps)
        for a, b in pieces(*bounds[got], piece_numel)
    )
    reduced = [x.stop - x.start for x in arrivals if x.kind != COPY]
    return RingPlan(tuple(pieces(*bounds[steps[0][0]], piece_numel)), phase[0], arrivals, len(reduced), max(reduced, default=0))


# --- binary tree rooted anywhere ------------------------------------------------------------


def tree_parent(rank: int, world: int, root: int = 0) -> int | None:
    """Parent of ``rank`` in the heap-ordered binary tree over ranks relabelled so ``root`` is 0."""
    v = (rank - root) % world
    return None if v == 0 else ((v - 1) // 2 + root) % world


def tree_children(rank: int, world: int, root: int = 0) -> list[int]:
    """Children (0, 1 or 2) of ``rank`` in the same tree; depth is floor(log2(world))."""
    v = (rank - root) % world
    return [(c + root) % world for c in (2 * v + 1, 2 * v + 2) if c < world]


# --- recursive halving / doubling (Rabenseifner; Thakur, Rabenseifner & Gropp 2005) ----------


def largest_power_of_two(n: int) -> int:
    """The largest power of two <= n (n >= 1)."""
    return 1 << (n.bit_length() - 1)


def hd_fold(rank: int, world: int) -> tuple[str, int | None, int | None]:
    """How a rank takes part when ``world`` is not a power of two.

    With p' = largest power of two <= world and r = world - p', the first 2r ranks pair up: each
    even rank hands its whole vector to rank+1 and sits out ("folded"), each odd rank reduces
    both and takes part as virtual rank rank // 2. Ranks >= 2r take part as rank - r. At the end
    every odd rank of the first 2r sends the result back to its even partner.

    Returns (role, virtual rank, partner): role "folded" (no virtual rank; partner rank+1),
    "proxy" (an odd rank standing in for a pair; partner rank-1) or "plain" (partner None).
    """
    r = world - largest_power_of_two(world)
    if rank < 2 * r:
        if rank % 2 == 0:
            return "folded", None, rank + 1
        return "proxy", rank // 2, rank - 1
    return "plain", rank - r, None


def hd_real_rank(virtual: int, world: int) -> int:
    """Inverse of the virtual numbering of :func:`hd_fold`."""
    r = world - largest_power_of_two(world)
    return 2 * virtual + 1 if virtual < r else virtual + r


@dataclass(frozen=True)
class HDStep:
    """One exchange: send blocks [send_lo, send_hi) to ``peer`` and receive [recv_lo, recv_hi)."""

    peer: int  # real group rank
    send: tuple[int, int]  # block range (of the p' blocks)
    recv: tuple[int, int]


def hd_reduce_scatter_steps(virtual: int, world: int) -> list[HDStep]:
    """Recursive halving over p' virtual ranks: log2(p') steps, distance p'/2, p'/4, ..., 1.

    At each step a rank keeps half of its current block range (the lower half if its bit at
    this distance is 0) and sends the other half to its partner, which keeps the complement.
    Virtual rank v ends owning the fully reduced block v.
    """
    pp = largest_power_of_two(world)
    lo, hi, mask, steps = 0, pp, pp // 2, []
    while mask >= 1:
        mid = lo + mask
        lower, upper = (lo, mid), (mid, hi)
        keep, give = (lower, upper) if virtual & mask == 0 else (upper, lower)
        steps.append(HDStep(peer=hd_real_rank(virtual ^ mask, world), send=give, recv=keep))
        lo, hi = keep
        mask //= 2
    return steps


def hd_all_gather_steps(virtual: int, world: int) -> list[HDStep]:
    """Recursive doubling: the halving steps in reverse, sending what was kept, receiving the rest."""
    return [HDStep(s.peer, s.recv, s.send) for s in reversed(hd_reduce_scatter_steps(virtual, world))]


def is_power_of_two(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


def check_power_of_two(world: int) -> None:
    """ValueError unless ``world`` is a power of two: recursive halving gives each of p ranks one
    block only when every step splits the ranks' ranges exactly in two (no fold for a lone
    reduce-scatter or all-gather: a folded rank would hold no block)."""
    if not is_power_of_two(world):
        raise ValueError(
            f"halving_doubling's reduce-scatter and all-gather need a power-of-two world size, got {world}: "
            "use algorithm 'ring' (any world size)"
        )


ElementStep = tuple[tuple[int, int], tuple[int, int], int]  # (elements sent, elements received, peer)


@lru_cache(maxsize=256)
def hd_element_steps(numel: int, world: int, rank: int, all_gather: bool = False) -> tuple[ElementStep, ...]:
    """Recursive-halving reduce-scatter (``all_gather``: recursive-doubling all-gather) of a flat
    vector of ``numel`` over a power-of-two ``world``, as element ranges: per step (sent, received,
    peer). Reduce-scatter: rank r ends holding the reduced block r of ``chunk_bounds(numel,
    world)``, the block the ring reduces into; all-gather: rank r starts from that block. Halving
    sends half of the range kept so far and keeps the other half; doubling is the reverse."""
    check_power_of_two(world)
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} outside 0..{world - 1}")
    bounds = chunk_bounds(numel, world)

    def span(blocks: tuple[int, int]) -> tuple[int, int]:
        return bounds[blocks[0]][0], bounds[blocks[1] - 1][1]

    steps = hd_all_gather_steps(rank, world) if all_gather else hd_reduce_scatter_steps(rank, world)
    return tuple((span(s.send), span(s.recv), s.peer) for s in steps)
