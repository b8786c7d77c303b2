"""Threads per rank: how many torch threads each of a machine's local ranks computes with.

The rule, in order: a fixed count where the caller names one (a sweep configuration's
``threads``, a calibration's); else ``OMP_NUM_THREADS`` where it is set (torch reads it in every
process, as torchrun sets it to 1); else the machine's cores shared out, ``cores // ranks``, at
least one. Why: N ranks that each start a thread per core oversubscribe a shared machine N
times over, and a time measured or profiled in the parent is a rank's time only if it was taken
with a rank's threads. :func:`commlab.launch` applies it in every rank it spawns; the planner and
the pipeline benchmark profile under it (:func:`rank_threads`), and calibration records it.

Torch is imported only where threads are set, so the rule itself is free to import anywhere.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager


def threads_per_rank(local_ranks: int, fixed: int | None = None, *, cores: int | None = None,
                     environ: Mapping[str, str] | None = None) -> int:
    """The torch threads of each of ``local_ranks`` ranks on one machine (pure, given ``cores``
    and ``environ``; by default ``os.cpu_count()`` and ``os.environ``): ``fixed`` when given, else
    ``OMP_NUM_THREADS`` when set and not empty, else ``cores // local_ranks``, at least one."""
    if local_ranks < 1:
        raise ValueError(f"local_ranks must be >= 1, got {local_ranks}")
    if fixed:
        return int(fixed)
    omp = (os.environ if environ is None else environ).get("OMP_NUM_THREADS")
    if omp:
        return int(omp)
    cores = (os.cpu_count() or 1) if cores is None else cores
    return max(1, cores // local_ranks)


def use_rank_threads(local_ranks: int, fixed: int | None = None) -> int:
    """Set this process's torch threads by :func:`threads_per_rank`; returns the count it had."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(threads_per_rank(local_ranks, fixed))
    return before


@contextmanager
def rank_threads(local_ranks: int, fixed: int | None = None) -> Iterator[int]:
    """Inside: this process computes with a rank's threads (to profile in the parent what the
    ranks will run; 2 threads per op on a shared machine came out up to 20x slower than 1);
    after: with the threads it had. Yields the rank's count."""
    import torch

    before = use_rank_threads(local_ranks, fixed)
    try:
        yield torch.get_num_threads()
    finally:
        torch.set_num_threads(before)
