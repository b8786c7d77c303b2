"""Shard layout: where a bucket's parameters lie in its flat padded buffer and in each rank's shard.

Pure functions, no processes. A bucket's parameters are laid end to end, in bucket order, in one
flat buffer; the buffer is padded with zeros to a multiple of the world size so that every rank
owns one contiguous shard of the same length (the layout ZeRO and torch's FSDP1 FlatParameter
use; the padding lets all-gather and reduce-scatter run on equal pieces). Rank r owns
``[r * shard_size, (r + 1) * shard_size)`` of the flat buffer, and a parameter overlaps a shard in
at most one contiguous piece of its flattened elements.

Example, numels (3, 2) on 2 ranks: flat ``a0 a1 a2 b0 b1 pad``, shard size 3; rank 0 holds
``a0 a1 a2`` (all of a), rank 1 holds ``b0 b1 pad`` (all of b plus the padding).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Piece:
    """The part of one parameter inside one rank's shard.

    ``param_start:param_end`` indexes the parameter's flattened elements, ``shard_start`` is where
    that piece starts inside the shard.
    """

    param: int
    param_start: int
    param_end: int
    shard_start: int

    @property
    def numel(self) -> int:
        return self.param_end - self.param_start


@dataclass(frozen=True)
class ShardLayout:
    """One bucket laid out flat and cut into ``world_size`` equal shards."""

    numels: tuple[int, ...]
    world_size: int

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"world_size must be positive, got {self.world_size}")
        if not self.numels:
            raise ValueError("a bucket holds at least one parameter")
        if any(n < 1 for n in self.numels):
            raise ValueError(f"every parameter needs at least one element, got numels {list(self.numels)}")

    @property
    def total(self) -> int:
        """Elements of the parameters, without padding."""
        return sum(self.numels)

    @property
    def shard_size(self) -> int:
        return -(-self.total // self.world_size)  # ceiling division

    @property
    def padded(self) -> int:
        """Elements of the flat buffer: the total rounded up to a multiple of the world size."""
        return self.shard_size * self.world_size

    @property
    def padding(self) -> int:
        return self.padded - self.total

    @property
    def offsets(self) -> tuple[int, ...]:
        """Where each parameter starts in the flat buffer."""
        starts, at = [], 0
        for n in self.numels:
            starts.append(at)
            at += n
        return tuple(starts)

    def shard_range(self, rank: int) -> tuple[int, int]:
        """[start, end) of rank's shard in the flat buffer."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside 0..{self.world_size - 1}")
        return rank * self.shard_size, (rank + 1) * self.shard_size

    def pieces(self, rank: int) -> list[Piece]:
        """The parameters (or their parts) inside rank's shard, in flat order; the shard's elements
        not covered by a piece are padding."""
        lo, hi = self.shard_range(rank)
        result = []
        for index, (start, n) in enumerate(zip(self.offsets, self.numels)):
            a, b = max(lo, start), min(hi, start + n)
            if a < b:
                result.append(Piece(index, a - start, b - start, a - lo))
        return result

    def valid(self, rank: int) -> int:
        """Elements of rank's shard that are parameters, not padding."""
        return sum(p.numel for p in self.pieces(rank))


def shard_layout(numels: Sequence[int], world_size: int) -> ShardLayout:
    """The layout of a bucket whose parameters have these element counts, in bucket order."""
    return ShardLayout(tuple(int(n) for n in numels), int(world_size))
