"""Full (unsharded) state: a module state dict loaded into the shards, the optimizer's gathered.

``load_full_state_dict`` needs no collective: every rank is given the same full values and keeps
its own shard of them. (The other way, torch's ``get_model_state_dict`` gathers the DTensor shards
one tensor at a time: ShardedDataParallel.full_state_dict.)

``full_optimizer_state_dict`` is the optimizer's own ``state_dict()`` with every DTensor (the
shards' state: Adam's moments, SGD's momentum buffer) gathered whole, loadable into the same
optimizer built over the unsharded module. torch's ``Optimizer.state_dict`` already numbers the
parameters (in the order of its groups) and keeps the groups and their hyper-parameters; the
parameters are the module's own, in its own shapes (commlab/sharded/dparams.py), so only the values
need gathering: ``full_tensor()`` of each DTensor, in index order, the same on every rank (a
collective: every rank calls it). Other state (Adam's scalar ``step``, the state of frozen,
replicated parameters) is the same on every rank and copied.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from commlab.sharded.engine import ShardedEngine


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


def check_full_gather(mesh) -> None:
    """NotImplementedError where torch's DTensor all-gather (what gathers a full state dict) is not
    safe: Gloo with CUDA tensors, where torch 2.11's functional all-gather crashed the process with
    a segmentation fault (an H200, two ranks on one GPU; scripts/gpu_check.py). Refused before any
    collective, on every rank alike."""
    group = mesh.get_group(mesh.ndim - 1)
    if mesh.device_type == "cuda" and str(dist.get_backend(group)).lower() == "gloo":
        raise NotImplementedError("a full state dict of CUDA parameters over Gloo: torch's DTensor all-gather "
                                  "crashes there; save the sharded state_dict() with torch.distributed.checkpoint, "
                                  "or use NCCL")


def full_optimizer_state_dict(optimizer: torch.optim.Optimizer) -> dict:
    sd = optimizer.state_dict()
    for value in (v for entry in sd["state"].values() for v in entry.values() if isinstance(v, DTensor)):
        check_full_gather(value.device_mesh)  # before any collective
        break
    state = {}
    for index in sorted(sd["state"]):
        state[index] = {
            key: (value.full_tensor() if isinstance(value, DTensor) else
                  value.clone() if isinstance(value, torch.Tensor) else value)
            for key, value in sorted(sd["state"][index].items())
        }
    return {"state": state, "param_groups": sd["param_groups"]}
