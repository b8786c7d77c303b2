"""A sequence of data-parallel buckets lowered onto the simulator core: one all-reduce task each.

The piece every lowering that has DDP buckets shares: the DDP step (commlab/costmodel/lower.py)
launches each bucket from its own launch task; a pipeline stage's buckets follow the stage's last
backward. Pure: sizes and a cost function in, :class:`commlab.sim.Task` records out::

    bucket_tasks([4 << 20, 1 << 20], allreduce, after=("B3s1",), channel="dp1", prefix="s1.allreduce")
    # -> s1.allreduce0 (deps B3s1), s1.allreduce1, on resource dp1 in that order

Tasks of one resource run in the order given (commlab/sim/core.py), so only the first bucket of
each channel needs the ``after`` dependency: the rest queue behind it, as collectives on a
process group run in the order they were issued.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from commlab.sim import Task

ALLREDUCE = "allreduce"


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
