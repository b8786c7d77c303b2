"""Keeping replicas identical outside backward: shape checks and rank-0 broadcasts of module state."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from commlab.collectives import run_ordered


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


# torch's _sync_module_states broadcasts in flat buffers of at most 250 MB
# (torch/distributed/utils.py, _sync_params_and_buffers: broadcast_bucket_size = 250 * 1024 * 1024).
BROADCAST_CHUNK_BYTES = 250 * 1024 * 1024


def broadcast_chunks(tensors: Sequence[torch.Tensor], limit: int = BROADCAST_CHUNK_BYTES) -> list[list[int]]:
    """Indices of ``tensors`` broadcast together: one (dtype, device) per chunk, in order of
    first appearance, each chunk at most ``limit`` bytes (a larger tensor is a chunk of its own)."""
    if limit <= 0:
        raise ValueError(f"limit must be positive, got {limit}")
    chunks: list[list[int]] = []
    open_chunk: dict[tuple[torch.dtype, torch.device], tuple[list[int], int]] = {}
    for i, t in enumerate(tensors):
        kind, nbytes = (t.dtype, t.device), t.numel() * t.element_size()
        current, size = open_chunk.get(kind, (None, 0))
        if current is None or size + nbytes > limit:
            current, size = [], 0
            chunks.append(current)
        current.append(i)
        open_chunk[kind] = (current, size + nbytes)
    return chunks


def broadcast_coalesced(
    tensors: Sequence[torch.Tensor], group, src_group_rank: int = 0, limit: int = BROADCAST_CHUNK_BYTES
) -> None:
    """Overwrite ``tensors`` with the values of group rank ``src_group_rank``: one flat broadcast
    per chunk of :func:`broadcast_chunks` (as torch's _broadcast_coalesced), so the extra memory
    is one chunk, never a flattened copy of the whole model; a lone contiguous tensor is
    broadcast in place. Issued on the group's one path (commlab.collectives.run_ordered)."""
    if not tensors:
        return
    src = dist.get_global_rank(group, src_group_rank) if group is not None else src_group_rank

    def issue() -> None:
        with torch.no_grad():
            for chunk in broadcast_chunks(tensors, limit):
                same_kind = [tensors[i].detach() for i in chunk]
                if len(same_kind) == 1 and same_kind[0].is_contiguous():
                    dist.broadcast(same_kind[0], src, group=group)
                    continue
                flat = _flatten_dense_tensors(same_kind)
                dist.broadcast(flat, src, group=group)
                for t, synced in zip(same_kind, _unflatten_dense_tensors(flat, same_kind)):
                    t.copy_(synced)

    run_ordered(group, issue)
