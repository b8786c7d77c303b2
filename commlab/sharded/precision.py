"""Mixed precision: the policy, each bucket's three dtypes, and the cast of forward inputs.

As torch's ``fully_shard`` with a ``MixedPrecisionPolicy``
(torch/distributed/fsdp/_fully_shard/_fsdp_param.py): the DTensor shards the optimizer holds
keep the parameters' own dtype (the master copy, fp32 in the usual setting); the shard is cast to
``param_dtype`` *before* the all-gather, so the bytes on the wire are the 16-bit ones, and the
forward and backward compute on those ``param_dtype`` whole tensors; their gradients are cast to
``reduce_dtype`` as they are copied into the reduction's buffer, reduced in it, and cast to the
master dtype as they land in the shard's ``.grad``.

Stages 1-2 keep a replica for compute: under mixed precision it is the ``param_dtype`` copy,
and the master is the rank's rows in a flat buffer of their own (as stage 3's shard), which the
optimizer steps and the all-gather after the step casts and sends. So a rank holds 2 bytes per
parameter of replica plus 4/N of master, the ZeRO paper's mixed-precision accounting
(commlab/sharded/memory_model.py). Stage 1's full reduced gradient stays in the reduction's
buffer (``reduce_dtype``) and is not given to the compute parameters, whose dtype differs.
Inside ``no_sync()`` each micro-batch's gradient is added to a sum in ``reduce_dtype``, as
fully_shard's is (FlatBucket.hold_gradient), not left to autograd's 16-bit ``.grad``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._pytree import tree_map


@dataclass(frozen=True)
class MixedPrecision:
    """``param_dtype``: the gathered parameters' and the computation's dtype (None: the
    parameters' own); ``reduce_dtype``: the gradient reduction's (None: ``param_dtype``);
    ``cast_forward_inputs``: the wrapper's forward casts floating-point tensor arguments to
    ``param_dtype`` (torch's default too)."""

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True


@dataclass(frozen=True)
class BucketDtypes:
    """One bucket's dtypes: the master shards', the computation's and the reduction's."""

    master: torch.dtype
    compute: torch.dtype
    reduce: torch.dtype

    @property
    def mixed(self) -> bool:
        return self.compute != self.master or self.reduce != self.master


def resolve(policy: Any) -> MixedPrecision | None:
    """``policy`` as a MixedPrecision (None: none); torch's ``MixedPrecisionPolicy`` is read by
    its fields. ValueError, before any process group is needed, for anything else and for what
    is not supported: ``output_dtype`` (fully_shard casts each unit's outputs with it; commlab
    has no per-unit policies to need it) and dtypes that are not floating point."""
    if policy is None:
        return None
    if not isinstance(policy, MixedPrecision):
        from torch.distributed.fsdp import MixedPrecisionPolicy

        if not isinstance(policy, MixedPrecisionPolicy):
            raise ValueError(
                "mixed_precision must be a commlab MixedPrecision or torch's MixedPrecisionPolicy, "
                f"got {type(policy).__name__}"
            )
        if policy.output_dtype is not None:
            raise ValueError(
                f"MixedPrecisionPolicy.output_dtype={policy.output_dtype} is not supported by "
                "ShardedDataParallel (it has one policy for the whole model): cast the output yourself"
            )
        policy = MixedPrecision(policy.param_dtype, policy.reduce_dtype, policy.cast_forward_inputs)
    for name in ("param_dtype", "reduce_dtype"):
        dtype = getattr(policy, name)
        if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            raise ValueError(f"mixed_precision.{name} must be a floating-point torch.dtype or None, got {dtype!r}")
    if not isinstance(policy.cast_forward_inputs, bool):
        raise ValueError(f"cast_forward_inputs must be True or False, got {policy.cast_forward_inputs!r}")
    return policy


def bucket_dtypes(policy: MixedPrecision | None, master: torch.dtype) -> BucketDtypes:
    """The dtypes of a bucket whose parameters are ``master`` (reduction defaults to the
    computation's dtype, as fully_shard's does)."""
    compute = policy.param_dtype if policy is not None and policy.param_dtype is not None else master
    reduce = policy.reduce_dtype if policy is not None and policy.reduce_dtype is not None else compute
    return BucketDtypes(master, compute, reduce)


def cast_inputs(policy: MixedPrecision | None, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Floating-point tensors among ``args`` and ``kwargs`` cast to ``param_dtype`` (when the
    policy asks for it); other values as they are."""
    if policy is None or policy.param_dtype is None or not policy.cast_forward_inputs:
        return args, kwargs
    dtype = policy.param_dtype

    def cast(x):
        return x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x

    return tree_map(cast, args), tree_map(cast, kwargs)
