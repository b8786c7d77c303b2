"""The full optimizer state dict: the shards' optimizer state, gathered and cut back into the
module's parameters, loadable into the same optimizer built over the unsharded module.

Each state tensor shaped like its shard (Adam's moments, SGD's momentum buffer) is all-gathered
into the bucket's flat layout (a collective: every rank calls it) and cut at the parameter
offsets; any other state (Adam's scalar ``step``) is the same on every rank and copied. Parameter
indices follow ``module.parameters()``, frozen parameters included (they get no state), as an
optimizer built over ``module.parameters()`` numbers them.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from commlab.sharded import comm
from commlab.sharded.flat_bucket import FlatBucket


def full_optimizer_state_dict(module: nn.Module, buckets: list[FlatBucket], optimizer: torch.optim.Optimizer) -> dict:
    if len(optimizer.param_groups) != 1:
        raise ValueError("full_optimizer_state_dict supports an optimizer with one parameter group")
    shard_ids = {id(b.shard) for b in buckets}
    group = optimizer.param_groups[0]
    if {id(p) for p in group["params"]} != shard_ids:
        raise ValueError("the optimizer must hold exactly this wrapper's shards (sharded.parameters())")
    index = {id(p): i for i, p in enumerate(module.parameters())}
    state: dict[int, dict[str, Any]] = {}
    for bucket in buckets:
        mine = optimizer.state.get(bucket.shard, {})
        per_param: list[dict[str, Any]] = [{} for _ in bucket.params]
        for key in sorted(mine):
            value = mine[key]
            if isinstance(value, torch.Tensor) and value.shape == bucket.shard.shape:
                full = torch.empty(bucket.layout.padded, dtype=value.dtype, device=value.device)
                comm.all_gather(full, value.detach().contiguous(), bucket.group, bucket.algorithm).wait()
                for slot, (p, offset) in enumerate(zip(bucket.params, bucket.layout.offsets)):
                    per_param[slot][key] = full[offset : offset + p.numel()].view(p.shape).clone()
            else:
                for entry in per_param:
                    entry[key] = value.clone() if isinstance(value, torch.Tensor) else value
        for p, entry in zip(bucket.params, per_param):
            if entry:
                state[index[id(p)]] = entry
    hyper = {k: v for k, v in group.items() if k != "params"}
    return {"state": state, "param_groups": [{**hyper, "params": list(range(len(index)))}]}

