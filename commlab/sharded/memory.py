"""What a rank holds now: bytes of parameter shards, gathered parameters, gradients and optimizer
state, read from the live tensors (each storage counted once, whole, as the allocator holds it).

The peak of gathered bytes is commlab's own accounting (every gather and free of a bucket), not
an allocator measurement: it leaves out activations, gradient buckets and temporaries. ``peak`` is
the allocator's measurement (commlab/memtrack.py) of a whole step, everything included, taken
only inside :func:`track_memory` (the CPU measurement runs the profiler, which a timed step must
not pay for).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor

from commlab.memtrack import live_bytes, track_peak
from commlab.sharded.engine import ShardedEngine

# engine -> peak bytes of its last tracked synchronised step (track_memory); weak, so a wrapper
# that goes keeps nothing here.
_PEAKS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


@dataclass(frozen=True)
class ShardedMemory:
    """Bytes on this rank. ``parameters`` is what holds parameter values: stages 1-2 the replica
    (the shards are views into it; under mixed precision the master shards beside a 16-bit
    replica), stage 3 the shards plus any gathered bucket."""

    parameter_shards: int
    gathered: int
    parameters: int
    gradients: int
    optimizer: int
    replicated: int  # frozen parameters kept whole (stages 1-2; stage 3 shards them)
    peak_gathered: int  # during the last synchronised step (forward to end of backward)
    # Measured (commlab/memtrack.py): live bytes at the step's start plus its allocations' peak,
    # for the last synchronised step run inside track_memory(); None if none was.
    peak: int | None = None


def storage_bytes(tensors: Iterable[torch.Tensor | None]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (views share their base's)."""
    seen: dict[int, int] = {}
    for t in tensors:
        if t is None:
            continue
        storage = t.untyped_storage()
        if storage.nbytes():
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def _local(t):
    return t.to_local() if isinstance(t, DTensor) else t


def measure(engine: ShardedEngine, frozen: list[torch.Tensor], optimizer=None) -> ShardedMemory:
    buckets = engine.buckets
    sharded = [dp for b in buckets for dp in b.sharded]
    shards = [b.shard if b.shard is not None else b.full for b in buckets]
    fulls = [b.full for b in buckets if b.gathered]
    grads = [b.grad_buffer for b in buckets] + [_local(dp.grad) for dp in sharded]
    grads += [p.grad for b in buckets for p in b.params] + [g for b in buckets for g in b.held.values()]
    state = []
    if optimizer is not None:
        for dp in sharded:
            state.extend(_local(v) for v in optimizer.state.get(dp, {}).values() if isinstance(v, torch.Tensor))
    return ShardedMemory(
        parameter_shards=sum(b.layout.shard_size * b.dtypes.master.itemsize for b in buckets),
        gathered=storage_bytes(fulls),
        parameters=storage_bytes([*shards, *fulls]),
        gradients=storage_bytes(grads),
        optimizer=storage_bytes(state),
        replicated=storage_bytes(frozen),
        peak_gathered=engine.last_peak_gathered,
        peak=_PEAKS.get(engine),
    )


@contextmanager
def track_memory(sharded) -> Iterator[None]:
    """Measure the peak bytes of each synchronised step of ``sharded`` (a ShardedDataParallel)
    run inside the block; ``sharded.memory().peak`` then holds the last one's.

    A step runs from the first forward after a synchronised backward to the next such forward
    (or the end of the block): its no_sync micro-batches, the synchronised one, the optimizer
    step and whatever the loop does before the next forward. Its peak is the live bytes at its
    start (:func:`commlab.memtrack.live_bytes`) plus the highest its allocations minus frees rise.
    Each step's all-gathers issued after the optimizer (stages 1-2) are waited for as it closes.
    On CPU the first step tracked can count too much (frees of blocks allocated before tracking
    are not seen, commlab/memtrack.py): read the peak after a second step.
    """
    engine: ShardedEngine = sharded._engine
    device = engine.buckets[0].full.device if engine.buckets else torch.device("cpu")
    window: dict = {}

    def last_synced():  # the record of the last synchronised step: a new one means a step ended
        return engine.recorder.iterations[-1] if engine.recorder.iterations else None

    def close() -> None:
        stack = window.pop("stack", None)
        if stack is None:
            return
        # Stages 1-2 launch their all-gathers at the end of the step: the profiler's window must
        # not close under them (commlab/memtrack.py).
        engine.settle()
        stack.close()
        if last_synced() is not window["synced"]:
            _PEAKS[engine] = window["entry"] + window["peak"].peak_bytes

    def open_() -> None:
        window["entry"] = live_bytes(device)
        window["synced"] = last_synced()
        window["stack"] = stack = ExitStack()
        window["peak"] = stack.enter_context(track_peak(device))

    def before_forward(module, args) -> None:
        if "stack" in window and last_synced() is window["synced"]:
            return  # this step has not synchronised yet (a no_sync micro-batch ran)
        close()
        open_()

    handle = sharded.register_forward_pre_hook(before_forward)
    try:
        yield
    finally:
        handle.remove()
        close()
