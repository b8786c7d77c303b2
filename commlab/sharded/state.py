"""Full (unsharded) module state dicts from and into the shards.

``full_state_dict`` gathers every bucket (a collective: every rank calls it) and returns the
module's own state dict, as the unwrapped module would give it. ``load_full_state_dict`` needs no
collective: every rank is given the same full values and keeps its own shard of them.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from commlab.sharded.engine import ShardedEngine


def full_state_dict(module: nn.Module, engine: ShardedEngine) -> dict[str, torch.Tensor]:
    """Under mixed precision the gathered parameters are the compute copies: the values given
    are the master shards', gathered whole (a DTensor all-gather, in state dict order on every rank)."""
    masters = {id(p): dp for b in engine.buckets if b.dtypes.mixed for p, dp in zip(b.params, b.sharded)}
    freed = engine.gather_all()
    try:
        out = {}
        for k, v in module.state_dict(keep_vars=True).items():
            dp = masters.get(id(v))
            out[k] = (dp.full_tensor() if dp is not None else v).detach().clone()
        return out
    finally:
        engine.free(freed)


def check_keys(module: nn.Module, state_dict: Mapping[str, torch.Tensor]) -> None:
    """ValueError naming the missing and unexpected keys, or the first mismatched shape."""
    expected = module.state_dict(keep_vars=True)
    missing = sorted(set(expected) - set(state_dict))
    unexpected = sorted(set(state_dict) - set(expected))
    if missing or unexpected:
        raise ValueError(
            f"state dict does not match the module: missing keys {missing}, unexpected keys {unexpected}"
        )
    for key, tensor in expected.items():
        if tuple(state_dict[key].shape) != tuple(tensor.shape):
            raise ValueError(
                f"state dict entry {key!r} has shape {tuple(state_dict[key].shape)}, the module's is {tuple(tensor.shape)}"
            )


def load_full_state_dict(module: nn.Module, engine: ShardedEngine, state_dict: Mapping[str, torch.Tensor]) -> None:
    check_keys(module, state_dict)
    engine.settle()  # no gather may write the buffers after the loaded values
    sharded = {id(p) for bucket in engine.buckets for p in bucket.params}
    name_of = {}
    with torch.no_grad():
        for key, tensor in module.state_dict(keep_vars=True).items():
            name_of.setdefault(id(tensor), key)
            if id(tensor) not in sharded:  # buffers and frozen parameters: replicated
                tensor.copy_(state_dict[key])
        for bucket in engine.buckets:
            bucket.write_full([state_dict[name_of[id(p)]] for p in bucket.params])
    # Stages 1-2: the replica now holds the loaded values everywhere; nothing to gather.
    engine.stale, engine.queued = False, []
