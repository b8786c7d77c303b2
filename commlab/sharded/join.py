"""Uneven inputs under ``ShardedDataParallel.join()``: detected, on every rank, before they hang.

Inside ``join()`` each forward first all-reduces an int per rank (1: this rank runs a forward),
and a rank leaving the context all-reduces zeros; while every rank runs (all ones) or every rank
has left (all zeros) nothing happens. Otherwise some rank ran out of batches while others went
on: each rank, the leavers in their exit and the others in their forward, gets the same sum and
raises the same ValueError before any collective of that iteration.

Why not torch DDP's join, which shadows a finished rank's collectives until every rank is done:
under ZeRO the finished rank owns shards. To shadow it, it would have to join every reduce-scatter
with zeros, step its shards with the optimizer the others step (its updates reach them through the
next all-gathers) and replay every all-gather of each forward and backward, in the order the
others' modules ask for them; torch's ``fully_shard`` has no join either. An error naming the
iteration is what a training loop can act on (equal batch counts, ``drop_last=True``).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch.distributed as dist

from commlab.sharded.ordering import agree


def uneven_message(active: dict[int, int], iteration: int) -> str | None:
    """From each data-parallel rank's flag (global rank -> 1: runs a forward): None while every rank
    runs or every rank has left; else the error (pure)."""
    if all(active.values()) or not any(active.values()):
        return None
    done = sorted(r for r, a in active.items() if not a)
    running = sorted(r for r, a in active.items() if a)
    return (
        f"uneven inputs inside ShardedDataParallel.join(): at iteration {iteration} (counted from 0 inside "
        f"join()) ranks {done} had no more batches while ranks {running} ran a forward. Sharded data "
        "parallelism cannot shadow a finished rank (it owns shards every step and gather needs); give every "
        "rank the same number of batches (DistributedSampler(drop_last=True), DataLoader(drop_last=True))"
    )


class UnevenInputs:
    """One ``join()`` context: the forwards counted, each one agreed on over ``groups`` (the shard
    group and the replicas')."""

    def __init__(self, groups):
        self.groups = groups
        self.iteration = 0

    def _agree(self, here: int) -> None:
        # Two ints per global rank: a member of the data-parallel grid, and running a forward.
        flags = [0] * (2 * dist.get_world_size())
        flags[2 * dist.get_rank()], flags[2 * dist.get_rank() + 1] = 1, here
        summed = agree(flags, self.groups)
        active = {r: summed[2 * r + 1] for r in range(len(summed) // 2) if summed[2 * r]}
        message = uneven_message(active, self.iteration)
        if message is not None:
            raise ValueError(message)

    def arrive(self, engine) -> None:
        """A forward starts on this rank (after the all-gathers the step launched, stages 1-2: the
        agreement runs after them, not beside them)."""
        engine.settle()
        self._agree(1)
        self.iteration += 1

    def leave(self, engine) -> None:
        """This rank left the context without an error: wait for the others to leave too."""
        engine.settle()
        self._agree(0)


@contextmanager
def joined(wrapper) -> Iterator[None]:
    """ShardedDataParallel.join(): inside, a rank out of batches while others run a forward is a
    ValueError on every rank at that iteration (this module's docstring)."""
    if wrapper._join is not None:
        raise RuntimeError("ShardedDataParallel.join() is already active")
    wrapper._join = UnevenInputs(wrapper._control)
    try:
        yield
        wrapper._join.leave(wrapper._engine)
    finally:
        wrapper._join = None
