"""Keeping replicas identical outside backward: shape checks and rank-0 broadcasts of module state."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors


def verify_param_shapes(names: Sequence[str], params: Sequence[torch.Tensor], group) -> None:
    """Raise ValueError naming the first parameter whose shape or dtype differs across ranks.

    torch does the same check (``_verify_param_shape_across_processes``) before its first
    broadcast, because a broadcast of mismatched tensors would fail obscurely or hang.
    """
    mine = [(name, tuple(p.shape), str(p.dtype)) for name, p in zip(names, params)]
    everyone: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, mine, group=group)
    reference = everyone[0]
    for rank, theirs in enumerate(everyone):
        if len(theirs) != len(reference):
            raise ValueError(
                f"DistributedDataParallel: rank {rank} has {len(theirs)} parameters, "
                f"rank 0 has {len(reference)}; every rank must wrap the same model"
            )
        for (name0, shape0, dtype0), (name, shape, dtype) in zip(reference, theirs):
            if (shape0, dtype0) != (shape, dtype):
                raise ValueError(
                    f"DistributedDataParallel: parameter {name!r} has shape {shape} ({dtype}) on "
                    f"rank {rank} but {shape0} ({dtype0}) on rank 0 (parameter {name0!r})"
                )


def broadcast_coalesced(tensors: Sequence[torch.Tensor], group, src_group_rank: int = 0) -> None:
    """Overwrite ``tensors`` with the values of group rank ``src_group_rank``, one flat
    broadcast per (dtype, device) instead of one per tensor (as torch's _broadcast_coalesced)."""
    if not tensors:
        return
    src = dist.get_global_rank(group, src_group_rank) if group is not None else src_group_rank
    kinds: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for t in tensors:
        kinds.setdefault((t.dtype, t.device), []).append(t)
    with torch.no_grad():
        for same_kind in kinds.values():
            flat = _flatten_dense_tensors([t.detach() for t in same_kind])
            dist.broadcast(flat, src, group=group)
            for t, synced in zip(same_kind, _unflatten_dense_tensors(flat, same_kind)):
                t.copy_(synced)
