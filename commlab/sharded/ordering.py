"""What every rank agrees on before a backward's collectives: who used which parameter, and the
order in which buckets are reduced.

Collectives on one group pair up by their position in each rank's sequence, so a rank whose graph
differs (a parameter, an output or a module unused here but used elsewhere) must not launch a
different sequence: its peers would wait in a collective it never starts. Two rules keep the
sequences rank-independent (docs/design.md, the sharded section, says why these and not others):

- At the first hook of a backward, every rank all-reduces one int per trainable parameter: 1 if
  its gradient accumulator runs in this backward (``torch._C._will_engine_execute_node``, the
  query torch's own ``register_multi_grad_hook`` makes) or it holds a gradient from ``no_sync``.
  A sum of 0 is a parameter no rank uses: it gets no gradient (``.grad`` stays None, as under
  ``fully_shard``). A sum between 0 and the world size refuses the backward on every rank, before
  any collective of it.
- Reductions launch in descending bucket index, as torch DDP's reducer launches its buckets in
  index order (reducer.cpp, ``next_bucket_``): a bucket whose gradients are in waits for every
  later one to launch, so a different order of readiness still gives the same sequence.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.distributed as dist


def in_order(cursor: int, ready: Sequence[bool]) -> tuple[list[int], int]:
    """The buckets to launch now, descending from ``cursor`` (the highest not launched) while
    each is ready, and the new cursor (-1: every bucket launched)."""
    launch = []
    while cursor >= 0 and ready[cursor]:
        launch.append(cursor)
        cursor -= 1
    return launch, cursor


def verdict(counts: Sequence[int], world: int) -> tuple[list[int], list[int]]:
    """From each parameter's count of ranks that used it: those no rank used, and those some
    ranks only used."""
    unused = [i for i, c in enumerate(counts) if c == 0]
    partial = [i for i, c in enumerate(counts) if 0 < c < world]
    return unused, partial


def partial_message(names: Sequence[str], counts: Sequence[int], world: int) -> str:
    shown = ", ".join(f"{n} ({c} of {world})" for n, c in zip(names, counts))
    return (
        f"parameters used in this backward on some ranks only (ranks that used each): {shown}. "
        "ShardedDataParallel reduces every gradient on every rank, so each trainable parameter must "
        "get a gradient on every rank or on none; run the same modules on every rank (a skipped "
        "module can add 0 * its output), or freeze the parameter (requires_grad=False) before wrapping"
    )


def accumulator(param: torch.Tensor):
    """The parameter's gradient accumulator (autograd's node for a leaf); held, so that it stays
    the one autograd uses (torch DDP's reducer keeps them for the same reason)."""
    return param.view_as(param).grad_fn.next_functions[0][0]


def will_accumulate(node) -> bool:
    """Inside a backward: does it run ``node``? False for one torch cannot say about (a leaf under
    ``torch.autograd.grad``, which returns gradients instead of accumulating them)."""
    try:
        return bool(torch._C._will_engine_execute_node(node))
    except RuntimeError:
        return False


def control_group(group):
    """The group the small host-side agreements run on: the group itself on Gloo; elsewhere a Gloo
    group of the same ranks, so that agreeing reads no device tensor (no wait for the device).
    A collective over the group's ranks (construction, where every rank is)."""
    if dist.get_backend(group) == "gloo":
        return group
    ranks = dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)
    return dist.new_group(ranks, backend="gloo", use_local_synchronization=True)


def control_groups(shard_group, replicate_group) -> list:
    """The groups of the agreements, which sum over every data-parallel rank: the shard group's,
    and the replicas' (HSDP) when given."""
    return [control_group(shard_group)] + ([control_group(replicate_group)] if replicate_group is not None else [])


def agree(flags: Sequence[int], groups: Sequence) -> list[int]:
    """Every data-parallel rank's ``flags`` summed: a blocking all-reduce of one int each in each of
    ``groups`` (the shard group, then the replicas', whose grid holds each rank once)."""
    t = torch.tensor(list(flags), dtype=torch.int32)
    for group in groups:
        dist.all_reduce(t, group=group)
    return t.tolist()


def data_parallel_size(groups: Sequence) -> int:
    return math.prod(dist.get_world_size(g) for g in groups)
