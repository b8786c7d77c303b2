"""Which rows, columns and sequence positions a tensor-parallel rank holds: pure index maths.

Every split is into ``tp`` equal, contiguous blocks (rank r holds block r), as Megatron-LM and
torch's ``Shard(dim)`` both cut a divisible dimension, so a shard here is the same slice as
torch's local tensor. Unequal blocks are refused rather than padded: a padded weight would
change what the layer computes.
"""

from __future__ import annotations

HEAD_ATTRIBUTES = ("heads", "n_heads", "num_heads", "n_head", "num_attention_heads")


def check_tp(tp: int) -> None:
    if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
        raise ValueError(f"the tensor-parallel size must be a positive integer, got {tp!r}")


def check_divides(tp: int, size: int, what: str) -> None:
    """ValueError naming ``what`` unless ``size`` splits into ``tp`` equal blocks."""
    check_tp(tp)
    if size % tp:
        raise ValueError(f"tensor-parallel size {tp} does not divide {what} ({size}): "
                         f"choose a tp that divides it, or leave the module out of the plan")


def block(size: int, tp: int, rank: int) -> tuple[int, int]:
    """``[lo, hi)`` of rank ``rank``'s block of a dimension of ``size``."""
    check_divides(tp, size, "the dimension")
    if not 0 <= rank < tp:
        raise ValueError(f"rank {rank} is outside a tensor-parallel group of {tp}")
    step = size // tp
    return rank * step, (rank + 1) * step


def head_count(owners: list[object]) -> int | None:
    """The attention head count of the nearest owner (innermost first) that declares one under a
    usual attribute name, or None: a colwise q/k/v must split whole heads."""
    for owner in owners:
        for name in HEAD_ATTRIBUTES:
            value = getattr(owner, name, None)
            if isinstance(value, int) and not isinstance(value, bool):
                return value
    return None
