"""Checks of ShardedDataParallel's arguments (before any collective) and of the optimizer (at its
first step).

The optimizer check is a global ``torch.optim`` step pre-hook
(``torch.optim.optimizer.register_optimizer_step_pre_hook``), held through a weak reference and
removed with the wrapper. Before every optimizer step in the process it refuses, with a
ValueError, an optimizer that holds the wrapped module's own (unsharded) parameters, and an
optimizer known not to be element-wise (see :data:`NOT_ELEMENTWISE`) over the shards.
"""

from __future__ import annotations

import weakref
import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

from commlab.runs.zero_stage import ZeroStage, parse_stage

# Optimizers whose update of an element depends on other elements of the same parameter (matrix
# factors, orthogonalisation, whole-parameter line searches): a flat shard that cuts parameters
# at arbitrary points gives them the wrong neighbours. Per-parameter norms (LAMB, LARS trust
# ratios) are the same case; torch ships none, so they cannot be recognised by name here.
NOT_ELEMENTWISE = ("Adafactor", "LBFGS", "Muon", "SparseAdam")


def check_arguments(module, stage, bucket_cap_mb, prefetch, reshard_after_forward) -> ZeroStage:
    """ValueError for the first bad argument; the stage, parsed, when all are good."""
    if not isinstance(module, nn.Module):
        raise ValueError(f"module must be an nn.Module, got {type(module).__name__}")
    zero = parse_stage(stage)  # ValueError for what is no stage at all
    if zero.ddp:
        raise ValueError(
            "stage=0 is replicated data parallelism (no sharding): use commlab.DistributedDataParallel"
        )
    if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 0:
        raise ValueError(f"prefetch must be a non-negative integer, got {prefetch!r}")
    if not (isinstance(bucket_cap_mb, (int, float)) and bucket_cap_mb > 0):
        raise ValueError(f"bucket_cap_mb must be positive, got {bucket_cap_mb!r}")
    if not isinstance(reshard_after_forward, bool):
        raise ValueError(f"reshard_after_forward must be True or False, got {reshard_after_forward!r}")
    devices = {t.device for t in (*module.parameters(), *module.buffers())}
    if len(devices) > 1:
        raise ValueError(
            f"the module is on several devices {sorted(map(str, devices))}; sharded data parallelism "
            "needs one module on one device per rank"
        )
    return zero


def optimizer_guard(owner, originals: set[int], shards: set[int]):
    """Register the step pre-hook for ``owner`` (held weakly), which knows the ids of the
    module's sharded parameters and of the shards; returns the hook's handle."""
    ref = weakref.ref(owner)

    def hook(optimizer: torch.optim.Optimizer, args, kwargs):
        if ref() is None:
            return None
        held = {id(p) for group in optimizer.param_groups for p in group["params"]}
        if held & originals:
            raise ValueError(
                "this optimizer holds the wrapped module's own parameters; with ShardedDataParallel "
                "build it over sharded.parameters() (the rank's shards)"
            )
        name = type(optimizer).__name__
        if held & shards and name in NOT_ELEMENTWISE:
            raise ValueError(
                f"{name} is not element-wise (it needs whole parameters), which flat shards do not "
                "give; use an element-wise optimizer such as SGD, Adam or AdamW"
            )
        return None

    return register_optimizer_step_pre_hook(hook)
