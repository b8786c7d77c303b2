"""Which trainable parameters share a bucket: by DDP's bucket policy, or by unit (module).

Without units the buckets are the bucket policy's (commlab/ddp/policy.py, the object commlab's
DistributedDataParallel takes as ``bucket_policy=``): its ``rebuild`` for gradients ready in
reverse parameter order, the order a backward produces them in (last layer first). That is the
question DDP asks after its first iteration, and the one the predictor asks through
``commlab.costmodel.lowering.buckets.assign(nbytes, reversed(range(n)), policy=...)``, so a policy
registered once shapes DDP's buckets, the sharded ones and the predicted ones alike. Sharded
buckets are never rebuilt from an observed order: a bucket is also the layout of the shards the
optimizer holds, fixed at construction.

Buckets are then put in forward order (each bucket's parameters in module order, buckets by their
first parameter), the order stage 3 gathers them in forward and, reversed, in backward. Frozen
parameters (``requires_grad=False``) join no bucket at stages 1-2 (which shard no parameters: they
stay replicated, as the module holds them); stage 3 shards them as fully_shard does, in buckets of
their own (by the same policy or units), which are gathered and never reduced (``sharded_plan``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from torch import nn

from commlab.ddp.assignment import TensorSpec
from commlab.ddp.policy import BucketPolicy, checked


@dataclass(frozen=True)
class BucketPlan:
    """Parameter indices (into the trainable parameters) of each bucket, in forward order, and the
    modules whose forward uses each bucket (its unit, or the modules that own its parameters)."""

    buckets: list[list[int]]
    owners: list[list[nn.Module]]


def policy_buckets(specs: Sequence[TensorSpec], policy: BucketPolicy) -> list[list[int]]:
    """The policy's buckets of parameters of these specs (module order), in forward order; pure.

    ValueError if the policy misses or repeats a parameter, or mixes dtypes or devices in a bucket
    (one flat buffer holds one kind)."""
    ready = list(reversed(range(len(specs))))  # backward: the last parameter's gradient first
    buckets = [sorted(b) for b in checked(policy.rebuild(list(specs), ready), len(specs), policy)]
    for b in buckets:
        if len({(specs[i].dtype, specs[i].device) for i in b}) > 1:
            raise ValueError(f"bucket policy {policy!r} put parameters of several dtypes or devices in one "
                             f"bucket {b}; a sharded bucket is one flat buffer of one kind")
    return sorted(buckets, key=lambda b: b[0])


def shardable(module: nn.Module, frozen: bool = False) -> list[tuple[str, nn.Parameter]]:
    """The module's trainable parameters, or with ``frozen`` its frozen floating-point ones (an
    integer one stays whole), each once (shared ones under their first name)."""
    if frozen:
        return [(name, p) for name, p in module.named_parameters() if not p.requires_grad and p.is_floating_point()]
    return [(name, p) for name, p in module.named_parameters() if p.requires_grad]


def owners_of(module: nn.Module) -> dict[int, list[nn.Module]]:
    """For each parameter (by id), the modules that hold it directly."""
    result: dict[int, list[nn.Module]] = {}
    for m in module.modules():
        for p in m.parameters(recurse=False):
            result.setdefault(id(p), []).append(m)
    return result


def plan_buckets(
    module: nn.Module, policy: BucketPolicy, units: Sequence[nn.Module] | None, frozen: bool = False
) -> BucketPlan:
    """The buckets of ``module``'s trainable parameters (``frozen``: of its frozen ones, indices
    into those): by ``policy``, or one per unit plus one for the parameters outside every unit;
    raises ValueError for bad units."""
    params = [p for _, p in shardable(module, frozen)]
    if not params:
        if frozen:
            return BucketPlan([], [])
        raise ValueError("the module has no trainable parameters to shard")
    index = {id(p): i for i, p in enumerate(params)}
    holders = owners_of(module)
    if units is None:
        buckets = policy_buckets([TensorSpec.of(p) for p in params], policy)
        owners = [_unique([m for i in b for m in holders[id(params[i])]]) for b in buckets]
        return BucketPlan(buckets, owners)
    if isinstance(units, nn.Module) and not isinstance(units, nn.ModuleList):
        # A Sequential would iterate its children, a Linear not at all: say what was meant.
        raise ValueError(f"units must be a list of submodules, got one module ({type(units).__name__}): "
                         "pass [module] for one unit, or list(module.children()) for one per child")
    submodules = {id(m) for m in module.modules()}
    taken: dict[int, int] = {}
    groups: list[tuple[list[int], list[nn.Module]]] = []
    for u, unit in enumerate(units):
        if not isinstance(unit, nn.Module) or id(unit) not in submodules:
            raise ValueError(f"units[{u}] is not a submodule of the wrapped module")
        if unit is module:
            raise ValueError(
                f"units[{u}] is the wrapped module itself: the parameters outside the units form the root bucket"
            )
        mine = [index[id(p)] for p in unit.parameters() if id(p) in index]
        if not mine:
            # fully_shard accepts a unit without parameters to shard; here it makes no bucket (its
            # frozen parameters, if any, stay replicated like every frozen parameter).
            continue
        for i in mine:
            if i in taken:
                raise ValueError(f"units[{taken[i]}] and units[{u}] overlap: they share parameter {i}")
            taken[i] = u
        if len({(params[i].dtype, params[i].device) for i in mine}) > 1:
            raise ValueError(f"units[{u}] mixes parameter dtypes or devices; a bucket holds one kind")
        groups.append((sorted(mine), [unit]))
    rest = [i for i in range(len(params)) if i not in taken]
    if rest:
        if len({(params[i].dtype, params[i].device) for i in rest}) > 1:
            raise ValueError("the parameters outside the units mix dtypes or devices; a bucket holds one kind")
        groups.append((rest, _unique([m for i in rest for m in holders[id(params[i])]])))
    groups.sort(key=lambda g: g[0][0])
    return BucketPlan([g[0] for g in groups], [g[1] for g in groups])


def sharded_plan(module: nn.Module, policy: BucketPolicy, units: Sequence[nn.Module] | None,
                 with_frozen: bool) -> tuple[list[tuple[str, nn.Parameter]], BucketPlan, list[bool]]:
    """The parameters to shard (trainable ones, then with ``with_frozen`` the frozen ones), their
    buckets (indices into that list) in forward order, and whether each bucket's parameters train."""
    named, plan = shardable(module), plan_buckets(module, policy, units)
    if not with_frozen:
        return named, plan, [True] * len(plan.buckets)
    frozen, fplan = shardable(module, frozen=True), plan_buckets(module, policy, units, frozen=True)
    params = named + frozen
    position = {id(p): i for i, (_, p) in enumerate(module.named_parameters())}
    groups = [(b, o, True) for b, o in zip(plan.buckets, plan.owners)]
    groups += [([len(named) + j for j in b], o, False) for b, o in zip(fplan.buckets, fplan.owners)]
    groups.sort(key=lambda g: position[id(params[g[0][0]][1])])
    return params, BucketPlan([g[0] for g in groups], [g[1] for g in groups]), [g[2] for g in groups]


def _unique(modules: list[nn.Module]) -> list[nn.Module]:
    seen, out = set(), []
    for m in modules:
        if id(m) not in seen:
            seen.add(id(m))
            out.append(m)
    return out
