"""Uneven inputs under ``ShardedDataParallel.join()``: detected, on every rank, before they hang.

Inside ``join()`` each forward first all-reduces one int per rank (1: this rank runs a forward),
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

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch.distributed as dist

from commlab.sharded.ordering import agree


def uneven_message(active: Sequence[int], iteration: int) -> str | None:
    """None while every rank runs or every rank has left; else the error (pure)."""
    if all(active) or not any(active):
        return None
    done = [r for r, a in enumerate(active) if not a]
    running = [r for r, a in enumerate(active) if a]
    return (
        f"uneven inputs inside ShardedDataParallel.join(): at iteration {iteration} (counted from 0 inside "
        f"join()) ranks {done} had no more batches while ranks {running} ran a forward. Sharded data "
        "parallelism cannot shadow a finished rank (it owns shards every step and gather needs); give every "
        "rank the same number of batches (DistributedSampler(drop_last=True), DataLoader(drop_last=True))"
    )


class UnevenInputs:
    """One ``join()`` context: the forwards counted, each one agreed on."""

    def __init__(self, group, rank: int, world: int):
        self.group, self.rank, self.world = group, rank, world
        self.iteration = 0

    def _agree(self, here: int) -> None:
        flags = [0] * self.world
        flags[self.rank] = here
        message = uneven_message(agree(flags, self.group), self.iteration)
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
    """ShardedDataParallel.join(): the wrapper's forwards agreed on inside (its ``_join``)."""
    if wrapper._join is not None:
        raise RuntimeError("ShardedDataParallel.join() is already active")
    group = wrapper.process_group
    wrapper._join = UnevenInputs(wrapper._control, dist.get_rank(group), dist.get_world_size(group))
    try:
        yield
        wrapper._join.leave(wrapper._engine)
    finally:
        wrapper._join = None
