"""Per-iteration timings of a sharded step: each collective's stamps and the exposed time.

Stamps are ``time.perf_counter()`` seconds relative to the start of the iteration's forward,
taken on the host: right for CPU (Gloo); on CUDA they would time the issue of work, not the GPU's
execution (DDP's CUDA events are not carried over yet).
Per collective (one all-gather or reduction of one bucket):

- ``kind``: "all_gather", "reduce_scatter" (stages 2-3) or "all_reduce" (stage 1), in the shard
  group, and with replicas (commlab/sharded/hybrid.py) "replicate_all_reduce", the reduced
  result's all-reduce across them, whose ``ready`` is its ``launched`` (its input was there);
- ``ready``: a reduction's bucket got its last gradient; for an all-gather, when it was asked for
  (its use, a prefetch ahead of it, or, stages 1-2, the optimizer step before the forward, whose
  stamps are then negative);
- ``launched``: the asynchronous call was issued to the backend;
- ``done``: commlab's wait on it returned. Gloo's reduce-scatter and all-gather handles give no
  completion callback, so this is an upper bound of completion; for a prefetched all-gather it is
  the moment the bucket was needed, if that came after completion.

Per iteration (a forward and the synchronised backward after it):

- ``forward``: forward start -> forward end; ``backward``: forward end -> end of backward compute;
- ``exposed_all_gather``: the time the training thread spent blocked waiting on all-gathers;
- ``exposed_reduction``: the time it spent blocked waiting on reductions after backward compute;
- ``total``: forward start -> gradients in the shards (end of backward).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

MAX_ITERATIONS = 10_000  # iterations kept (deque maxlen), as DDP keeps


@dataclass
class CollectiveTiming:
    bucket: int
    kind: str
    nbytes: int
    ready: float
    launched: float
    done: float = float("nan")


@dataclass
class ShardedIterationTiming:
    forward: float
    backward: float
    exposed_all_gather: float
    exposed_reduction: float
    total: float
    collectives: list[CollectiveTiming] = field(default_factory=list)


class Recorder:
    """Stamps of the iteration in progress (absolute), turned relative when it ends."""

    def __init__(self) -> None:
        self.iterations: deque[ShardedIterationTiming] = deque(maxlen=MAX_ITERATIONS)
        self.start()

    def start(self, carry: list[CollectiveTiming] = ()) -> None:
        """A new iteration; ``carry``: collectives launched before it that belong to it."""
        self.t0 = time.perf_counter()
        self.forward_end = self.t0
        self.collectives: list[CollectiveTiming] = list(carry)
        self.waited_gather = 0.0
        self.waited_reduction = 0.0

    def launched(self, bucket: int, kind: str, nbytes: int, ready: float | None = None) -> CollectiveTiming:
        now = time.perf_counter()
        entry = CollectiveTiming(bucket, kind, nbytes, now if ready is None else ready, now)
        self.collectives.append(entry)
        return entry

    def wait(self, work, entry: CollectiveTiming) -> None:
        """Wait for ``work``, stamp ``entry`` done and count the blocked time as exposed."""
        before = time.perf_counter()
        work.wait()
        entry.done = time.perf_counter()
        if entry.kind == "all_gather":
            self.waited_gather += entry.done - before
        else:
            self.waited_reduction += entry.done - before

    def end(self, backward_end: float) -> None:
        t0, end = self.t0, time.perf_counter()
        for c in self.collectives:
            c.ready, c.launched, c.done = c.ready - t0, c.launched - t0, c.done - t0
        self.iterations.append(
            ShardedIterationTiming(
                forward=self.forward_end - t0,
                backward=backward_end - self.forward_end,
                exposed_all_gather=self.waited_gather,
                exposed_reduction=self.waited_reduction,
                total=end - t0,
                collectives=self.collectives,
            )
        )
        self.start()  # collectives until the next forward (a state dict's gathers) go elsewhere
