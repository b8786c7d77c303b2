"""Checks of ShardedDataParallel's arguments (before any collective) and of the optimizer (at its
first step).

The optimizer check is a global ``torch.optim`` step pre-hook
(``torch.optim.optimizer.register_optimizer_step_pre_hook``), held through a weak reference and
removed with the wrapper. Before every optimizer step in the process it refuses, with a
ValueError, an optimizer that holds the whole tensors a forward computes on, and an optimizer
over the shards that is not known to be correct on them (:func:`check_optimizer`).
"""

from __future__ import annotations

import weakref
import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

from commlab.runs.zero_stage import ZeroStage, parse_stage

# Optimizers whose every operation is element-wise or a per-parameter reduction that DTensor
# computes over the mesh (torch's own, which the tests run against fully_shard and DDP).
ELEMENTWISE = frozenset({"SGD", "Adam", "AdamW", "Adagrad", "Adamax", "NAdam", "RAdam", "RMSprop", "Adadelta",
                         "ASGD", "Rprop"})
# torch's optimizers that need more than a DTensor can give: a closure re-evaluating the whole model
# (LBFGS), sparse gradients (SparseAdam).
NOT_SUPPORTED = frozenset({"LBFGS", "SparseAdam"})


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
    scalars = [name for name, p in module.named_parameters() if p.requires_grad and p.ndim == 0]
    if scalars:
        raise ValueError(f"0-dimensional trainable parameters {scalars} cannot be sharded along dim 0: "
                         "give them shape (1,) or freeze them")
    devices = {t.device for t in (*module.parameters(), *module.buffers())}
    if len(devices) > 1:
        raise ValueError(
            f"the module is on several devices {sorted(map(str, devices))}; sharded data parallelism "
            "needs one module on one device per rank"
        )
    return zero


def optimizer_guard(owner, wholes: set[int], shards: set[int]):
    """Register the step pre-hook for ``owner`` (held weakly), which knows the ids of the
    module's whole (compute) parameters and of its DTensor shards; returns the hook's handle."""
    ref = weakref.ref(owner)

    def hook(optimizer: torch.optim.Optimizer, args, kwargs):
        if ref() is None:
            return None
        check_optimizer(optimizer, {id(p) for group in optimizer.param_groups for p in group["params"]}, wholes, shards)
        return None

    return register_optimizer_step_pre_hook(hook)


def check_optimizer(optimizer, held: set[int], wholes: set[int], shards: set[int]) -> None:
    """ValueError for an optimizer over the whole tensors, or one not known to be correct on
    DTensor shards (third-party optimizers whose update reads whole parameters, LAMB or LARS
    trust ratios, factored or orthogonalised moments, may work on DTensors through their
    operations or may not: their author opts in with ``optimizer.elementwise = True``)."""
    if held & wholes:
        raise ValueError(
            "this optimizer holds the whole tensors a forward computes on; build it over "
            "sharded.parameters() (the module's parameters, sharded) outside the forward"
        )
    if not held & shards:
        return
    name = type(optimizer).__name__
    if name in NOT_SUPPORTED:
        raise ValueError(f"{name} is not supported on sharded parameters (it needs whole parameters or sparse "
                         "gradients); use an element-wise optimizer such as SGD, Adam or AdamW")
    optin = getattr(optimizer, "elementwise", None)
    if type(optimizer).__module__.startswith("torch.optim") and name in ELEMENTWISE or optin is True:
        return
    raise ValueError(
        f"{name} is not known to be correct on sharded parameters: each rank holds some rows of each "
        "parameter (a DTensor), and an update that reads a whole parameter (a per-parameter norm as in "
        "LAMB or LARS, factored moments, orthogonalisation) is only right if it goes through DTensor "
        f"operations. If every operation of {name} does (or is element-wise), set "
        "optimizer.elementwise = True before its first step"
    )
