"""A sequence of data-parallel buckets lowered onto the simulator core: one all-reduce task each.

The piece every lowering that has DDP buckets shares: the DDP step (commlab/costmodel/lowering/ddp.py)
launches each bucket from its own launch task; a pipeline stage's buckets follow the stage's last
backward. Pure: sizes and a cost function in, :class:`commlab.sim.Task` records out::

    bucket_tasks([4 << 20, 1 << 20], allreduce, after=("B3s1",), channel="dp1", prefix="s1.allreduce")
    # -> s1.allreduce0 (deps B3s1), s1.allreduce1, on resource dp1 in that order

:func:`assign` gives the buckets themselves, from the bucket policy DDP uses.

Tasks of one resource run in the order given (commlab/sim/core.py), so only the first bucket of
each channel needs the ``after`` dependency: the rest queue behind it, as collectives on a
process group run in the order they were issued.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from commlab.sim import Task

ALLREDUCE = "allreduce"
DEFAULT_POLICY = "size_cap"  # commlab.ddp.policy.DEFAULT_POLICY (that package imports torch; a test holds them equal)


def assign(param_nbytes: Sequence[int], ready_order: Sequence[int], *, policy: Any = DEFAULT_POLICY,
           bucket_cap_mb: float | None = None, first_bucket_mb: float | None = None) -> list[list[int]]:
    """The steady-state buckets (reduction order) of parameters of these sizes whose gradients
    become ready in ``ready_order``: the bucket policy's rebuild, as the real DDP makes them after
    its first iteration. ``policy``: a name or instance (commlab/ddp/policy.py)."""
    # Lazy: commlab.ddp imports torch, and the lowerings stay torch-free until they assign buckets.
    import torch

    from commlab.ddp.assignment import TensorSpec
    from commlab.ddp.policy import checked, make_policy

    chosen = make_policy(policy, bucket_cap_mb=bucket_cap_mb, first_bucket_mb=first_bucket_mb)
    specs = [TensorSpec(n, torch.float32, torch.device("cpu")) for n in param_nbytes]
    return checked(chosen.rebuild(specs, list(ready_order)), len(specs), chosen)


def bucket_tasks(
    bucket_nbytes: Sequence[int],
    cost_fn: Callable[[int], float],
    *,
    after: Sequence[str] = (),
    channel: str | Sequence[str] = "dp",
    prefix: str = ALLREDUCE,
    host: str | None = None,
    launched_by: Sequence[str] | None = None,
) -> list[Task]:
    """One all-reduce task per bucket, in bucket (reduction) order.

    Bucket k is task ``f"{prefix}{k}"`` of kind ``"allreduce"`` lasting ``cost_fn(nbytes)``, with
    ``meta={"bucket": k, "nbytes": ...}``. ``channel``: the resource of every bucket, or one per
    bucket (round-robin process groups). ``after``: task names the first bucket of each channel
    waits for. ``launched_by[k]``: a task bucket k also waits for (its launch, in DDP). ``host``:
    the host whose compute the all-reduces contend with (None: they contend with nothing).
    """
    n = len(bucket_nbytes)
    channels = [channel] * n if isinstance(channel, str) else list(channel)
    if len(channels) != n:
        raise ValueError(f"channel: one name per bucket needed, got {len(channels)} for {n} buckets")
    if launched_by is not None and len(launched_by) != n:
        raise ValueError(f"launched_by: one task per bucket needed, got {len(launched_by)} for {n} buckets")
    tasks, seen = [], set()
    for k, nbytes in enumerate(bucket_nbytes):
        deps = () if channels[k] in seen else tuple(after)
        seen.add(channels[k])
        if launched_by is not None:
            deps = (*deps, launched_by[k])
        tasks.append(Task(f"{prefix}{k}", channels[k], cost_fn(nbytes), deps, ALLREDUCE, host,
                          meta={"bucket": k, "nbytes": nbytes}))
    return tasks
