"""Which trainable parameters share a bucket: by size (DDP's assignment) or by unit (module).

Buckets are in forward order (the order of their first parameter in ``module.parameters()``),
which is the order stage 3 gathers them in forward and, reversed, in backward. Frozen parameters
(``requires_grad=False``) join no bucket: they stay replicated, as the module holds them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from torch import nn

from commlab.ddp.assignment import MIB, compute_bucket_assignment_by_size


@dataclass(frozen=True)
class BucketPlan:
    """Parameter indices (into the trainable parameters) of each bucket, in forward order, and the
    modules whose forward uses each bucket (its unit, or the modules that own its parameters)."""

    buckets: list[list[int]]
    owners: list[list[nn.Module]]


def size_buckets(params: Sequence[nn.Parameter], bucket_cap_mb: float) -> list[list[int]]:
    """Buckets by size: the one call into DDP's bucket assignment (torch's
    compute_bucket_assignment_by_size), kept in one place so a bucket policy can replace it."""
    indices, _ = compute_bucket_assignment_by_size(list(params), [int(bucket_cap_mb * MIB)])
    return indices  # sorted by smallest index: forward order


def trainable(module: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """The module's trainable parameters, each once (shared ones under their first name)."""
    return [(name, p) for name, p in module.named_parameters() if p.requires_grad]


def owners_of(module: nn.Module) -> dict[int, list[nn.Module]]:
    """For each parameter (by id), the modules that hold it directly."""
    result: dict[int, list[nn.Module]] = {}
    for m in module.modules():
        for p in m.parameters(recurse=False):
            result.setdefault(id(p), []).append(m)
    return result


def plan_buckets(module: nn.Module, bucket_cap_mb: float, units: Sequence[nn.Module] | None) -> BucketPlan:
    """The buckets of ``module``'s trainable parameters; raises ValueError for bad units."""
    params = [p for _, p in trainable(module)]
    if not params:
        raise ValueError("the module has no trainable parameters to shard")
    index = {id(p): i for i, p in enumerate(params)}
    holders = owners_of(module)
    if units is None:
        buckets = size_buckets(params, bucket_cap_mb)
        owners = [_unique([m for i in b for m in holders[id(params[i])]]) for b in buckets]
        return BucketPlan(buckets, owners)
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
            raise ValueError(f"units[{u}] ({type(unit).__name__}) holds no trainable parameters")
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


def _unique(modules: list[nn.Module]) -> list[nn.Module]:
    seen, out = set(), []
    for m in modules:
        if id(m) not in seen:
            seen.add(id(m))
            out.append(m)
    return out
