"""A bucket's collective in flight: launched (all-reduce or comm hook), stamped, waited for.

Steps 3 and 4 of the reducer's life cycle (commlab/ddp/reducer.py) as seen from one bucket: the
launch hands the bucket to its channel (or to the comm hook), the chained future stamps when the
collective really started and finished (definitions in commlab/ddp/timing.py), and the wait at
the end of backward is bounded by the group's timeout and names the bucket on failure.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import torch
import torch.distributed as dist

from commlab import collectives
from commlab.ddp.bucket import Bucket, GradBucket


def launch(
    bucket: Bucket, *, last: int, hook: Callable | None, state: Any, groups: Sequence, algorithm: str, clock: Any,
    queued: dict[int, Any],
) -> None:  # fmt: skip
    """Start ``bucket``'s reduction: the comm hook's future, or ``algorithm`` on the bucket's
    round-robin group; ``last`` is the position of the last bucket (torch's GradBucket.is_last)."""
    bucket.launched_at = clock.stamp()
    future, handle = start(bucket, last=last, hook=hook, state=state, groups=groups, algorithm=algorithm)
    # "done" is stamped when the collective completes (on the thread completing it), not when
    # the end of backward gets round to waiting; waiting on the chained future also makes the
    # stamp visible before the iteration is recorded.
    bucket.future = future.then(partial(_done, bucket, handle, clock, queued))


def start(
    bucket: Bucket, *, last: int, hook: Callable | None, state: Any, groups: Sequence, algorithm: str,
) -> tuple[torch.futures.Future, Any]:  # fmt: skip
    """The one way a bucket's reduction is issued (the reducer's :func:`launch`, and a joined
    rank's shadow of it in commlab/ddp/join.py): the comm hook on the bucket, or ``algorithm`` on
    its round-robin group. Returns the future and the collective's handle (None for a hook)."""
    if hook is not None:
        return hook(state, GradBucket(bucket, bucket.position == last)), None
    group = groups[bucket.position % len(groups)]
    handle = collectives.all_reduce(bucket.buffer, "sum", algorithm=algorithm, group=group, async_op=True)
    return handle.get_future(), handle


def _done(bucket: Bucket, handle: Any, clock: Any, queued: dict[int, Any], future: torch.futures.Future) -> Any:
    value = future.value()  # re-raises a failed collective into the chained future
    bucket.done_at = clock.stamp()
    queued[bucket.position] = bucket.launched_at  # handed over (timing.py: queued)
    if handle is not None and handle.launched is not None:  # when it really started (timing.py)
        bucket.launched_at = handle.launched
    return value


def wait(bucket: Bucket, *, buckets: int, timeout: float, hooked: bool, algorithm: str, group: Any) -> torch.Tensor:
    """Wait for ``bucket`` (at most twice the group's timeout); a failure names the bucket and how
    it was reduced (its comm hook if ``hooked``, else ``algorithm``), on every rank (each rank's
    wait fails). Runs once per bucket per iteration, so the messages are built only on failure."""
    future = bucket.future
    try:
        return collectives.wait_future(future, 2 * timeout, f"bucket {bucket.position}")
    except Exception as exc:
        how = "its comm hook" if hooked else f"all-reduce algorithm {algorithm!r}"
        raise RuntimeError(
            f"DistributedDataParallel: bucket {bucket.position} of {buckets} "
            f"({bucket.nbytes} bytes, {len(bucket.params)} parameters) failed on rank "
            f"{dist.get_rank(group)} in {how}: {type(exc).__name__}: {exc}"
        ) from exc
