"""All-reduce algorithms written on torch.distributed point-to-point ops, and their registry."""

from __future__ import annotations

import torch

from commlab.collectives import native  # noqa: F401  (registers "native")
from commlab.collectives.registry import algorithm_names, get_algorithm

OPS = ("sum", "avg", "max", "min")


def all_reduce(tensor: torch.Tensor, op: str = "sum", *, algorithm: str = "ring", group=None, async_op: bool = False):
    """Reduce ``tensor`` in place across the group, like ``dist.all_reduce``.

    With ``async_op=True`` returns a handle with ``wait()`` and ``get_future()``.
    """
    if op not in OPS:
        raise ValueError(f"unknown reduce op {op!r}: choose from {', '.join(OPS)}")
    return get_algorithm(algorithm)(tensor, op, group=group, async_op=async_op)


__all__ = ["OPS", "algorithm_names", "all_reduce", "get_algorithm"]
