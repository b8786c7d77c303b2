"""Shard layout: each parameter cut along dim 0 into one piece per rank, and a bucket's pieces
laid rank-major in one flat buffer. Pure functions, no processes.

Each parameter is sharded on its own, as torch's ``fully_shard`` (FSDP2) shards it
(torch/distributed/fsdp/_fully_shard/_fsdp_param.py): its rows are split with ``torch.chunk``'s
rule, ``c = ceil(rows / N)`` rows per rank, so rank r holds rows ``[r c, min((r + 1) c, rows))``,
possibly none; each piece is padded to ``c`` rows. A rank's shard of a bucket is its padded
pieces end to end (``shard_offsets``), and the flat buffer the collectives run on is the ranks'
shards one after the other (rank-major): an all-gather or a reduce-scatter of equal blocks. The
parameters themselves, unsharded, lie end to end unpadded in another buffer (``offsets``); the
copy between the two orders is commlab/sharded/copies.py.

Example, shapes (3,) and (2, 2) on 2 ranks: c = 2 and 1; rank 0's shard is ``a0 a1 | b00 b01``,
rank 1's ``a2 pad | b10 b11``; shard size 4, flat buffer 8 elements for 7 parameters' worth.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class ShardLayout:
    """One bucket's parameters (their shapes, in bucket order) sharded over ``world_size`` ranks."""

    shapes: tuple[tuple[int, ...], ...]
    world_size: int

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"world_size must be positive, got {self.world_size}")
        if not self.shapes:
            raise ValueError("a bucket holds at least one parameter")
        if any(len(s) == 0 for s in self.shapes):
            raise ValueError("a 0-dimensional parameter has no dim 0 to shard: give it shape (1,)")
        if any(math.prod(s) < 1 for s in self.shapes):
            raise ValueError(f"every parameter needs at least one element, got shapes {list(self.shapes)}")

    @property
    def numels(self) -> tuple[int, ...]:
        return tuple(math.prod(s) for s in self.shapes)

    def row_numel(self, i: int) -> int:
        return math.prod(self.shapes[i][1:])

    def chunk_rows(self, i: int) -> int:
        """Rows of parameter i in each rank's (padded) piece: torch.chunk's ceil(rows / N)."""
        return -(-self.shapes[i][0] // self.world_size)

    def local_rows(self, i: int, rank: int) -> int:
        """Rows of parameter i that rank holds (0 where torch.chunk gives fewer chunks than ranks)."""
        self._check_rank(rank)
        c = self.chunk_rows(i)
        return max(0, min(c, self.shapes[i][0] - rank * c))

    def local_shape(self, i: int, rank: int) -> tuple[int, ...]:
        return (self.local_rows(i, rank), *self.shapes[i][1:])

    @property
    def shard_numels(self) -> tuple[int, ...]:
        """Elements of each parameter's padded piece in a shard."""
        return tuple(self.chunk_rows(i) * self.row_numel(i) for i in range(len(self.shapes)))

    @property
    def shard_offsets(self) -> tuple[int, ...]:
        """Where each parameter's piece starts inside a rank's shard."""
        return _starts(self.shard_numels)

    @property
    def offsets(self) -> tuple[int, ...]:
        """Where each parameter starts in the unsharded, unpadded buffer."""
        return _starts(self.numels)

    @property
    def total(self) -> int:
        """Elements of the parameters, without padding."""
        return sum(self.numels)

    @property
    def shard_size(self) -> int:
        return sum(self.shard_numels)

    @property
    def padded(self) -> int:
        """Elements of the rank-major flat buffer: N shards."""
        return self.shard_size * self.world_size

    @property
    def padding(self) -> int:
        return self.padded - self.total

    def shard_range(self, rank: int) -> tuple[int, int]:
        """[start, end) of rank's shard in the rank-major flat buffer."""
        self._check_rank(rank)
        return rank * self.shard_size, (rank + 1) * self.shard_size

    def valid(self, rank: int) -> int:
        """Elements of rank's shard that are parameters, not padding."""
        return sum(self.local_rows(i, rank) * self.row_numel(i) for i in range(len(self.shapes)))

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside 0..{self.world_size - 1}")


def _starts(sizes: Sequence[int]) -> tuple[int, ...]:
    starts, at = [], 0
    for n in sizes:
        starts.append(at)
        at += n
    return tuple(starts)


def shard_layout(shapes: Sequence[Sequence[int]], world_size: int) -> ShardLayout:
    """The layout of a bucket whose parameters have these shapes, in bucket order."""
    return ShardLayout(tuple(tuple(int(d) for d in s) for s in shapes), int(world_size))
