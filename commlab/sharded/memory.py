"""What a rank holds now: bytes of parameter shards, gathered parameters, gradients and optimizer
state, read from the live tensors (each storage counted once, whole, as the allocator holds it).

The peak of gathered bytes is commlab's own accounting (every gather and free of a bucket), not
an allocator measurement: it leaves out activations, gradient buckets and temporaries.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from commlab.sharded.engine import ShardedEngine


@dataclass(frozen=True)
class ShardedMemory:
    """Bytes on this rank. ``parameters`` is what holds parameter values: stages 1-2 the replica
    (the shards are views into it), stage 3 the shards plus any gathered bucket."""

    parameter_shards: int
    gathered: int
    parameters: int
    gradients: int
    optimizer: int
    replicated: int  # frozen parameters, outside the shards
    peak_gathered: int  # during the last synchronised step (forward to end of backward)


def storage_bytes(tensors: Iterable[torch.Tensor | None]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (views share their base's)."""
    seen: dict[int, int] = {}
    for t in tensors:
        if t is None:
            continue
        storage = t.untyped_storage()
        if storage.nbytes():
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def measure(engine: ShardedEngine, frozen: list[torch.Tensor], optimizer=None) -> ShardedMemory:
    buckets = engine.buckets
    shards = [b.shard for b in buckets]
    fulls = [b.full for b in buckets if b.gathered]
    grads = [b.grad_buffer for b in buckets] + [b.shard.grad for b in buckets]
    grads += [p.grad for b in buckets for p in b.params]
    state = []
    if optimizer is not None:
        for s in shards:
            state.extend(v for v in optimizer.state.get(s, {}).values() if isinstance(v, torch.Tensor))
    return ShardedMemory(
        parameter_shards=sum(s.numel() * s.element_size() for s in shards),
        gathered=storage_bytes(fulls),
        parameters=storage_bytes([*shards, *fulls]),
        gradients=storage_bytes(grads),
        optimizer=storage_bytes(state),
        replicated=storage_bytes(frozen),
        peak_gathered=engine.last_peak_gathered,
    )
