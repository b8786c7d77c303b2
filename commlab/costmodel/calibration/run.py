"""One calibration run: its ranks spawned with a rank's threads, the load around them, how steady it was.

Every calibration goes through :func:`run_calibration`: the DDP and ZeRO terms
(commlab/costmodel/calibration/driver.py) and the pipeline planner's
(commlab/costmodel/planner/calibrate.py). It spawns ``world_size`` ranks (:func:`commlab.launch`),
each computing with the threads commlab/runtime/threads.py gives a rank (or the ``threads``
asked for), runs the calibration's own rank function on each, and judges the run
(:func:`commlab.costmodel.terms.uncertainty.judge`) from the spread of the ranks' repeated
samples, which the caller reads out of their results, and from the machine's load before and
after: a calibration taken on a busy machine says so. Inside the ranks, timing is
commlab/runtime/timer.py's; caching an entry is the caller's (commlab/costmodel/calibration/cache.py).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from commlab.costmodel.terms import uncertainty
from commlab.runtime.threads import threads_per_rank, use_rank_threads


@dataclass(frozen=True)
class CalibrationRun:
    """What one calibration launch returned, and how far to trust it."""

    results: list[Any]  # each rank's, in rank order
    threads: int  # torch threads per rank
    seconds: float  # the launch, from just before its first rank started
    steadiness: uncertainty.Steadiness


def run_calibration(rank_fn: Callable[..., Any], *args: Any, world_size: int, backend: str, timeout: float,
                    spread: Callable[[list[Any]], float], threads: int | None = None) -> CalibrationRun:
    """``rank_fn(*args)`` on ``world_size`` ranks of ``backend`` (``rank_fn`` importable by name),
    each with ``threads`` torch threads (default: a rank's, commlab/runtime/threads.py);
    ``spread(results)``: the relative spread of their repeated samples
    (:func:`~commlab.costmodel.terms.uncertainty.overall_spread`)."""
    import commlab  # commlab.launch imports torch: loaded only when calibrating

    threads = threads_per_rank(world_size, threads)
    begin = time.monotonic()
    load_before, running_before = os.getloadavg()[0], runnable_now()
    results = commlab.launch(_with_threads, threads, rank_fn, *args, world_size=world_size, backend=backend,
                             timeout=timeout)
    load_after = os.getloadavg()[0]
    seconds = time.monotonic() - begin
    steadiness = uncertainty.judge(spread(results), load_before, load_after, cpus=os.cpu_count() or 1,
                                   own_threads=world_size * threads, seconds=seconds, running_before=running_before)
    return CalibrationRun(results, threads, seconds, steadiness)


def _with_threads(threads: int, rank_fn: Callable[..., Any], *args: Any) -> Any:
    """On a rank: set its torch threads, then run the calibration's own rank function."""
    import torch.distributed as dist

    use_rank_threads(dist.get_world_size(), fixed=threads)
    return rank_fn(*args)


def runnable_now(samples: int = 10, every_s: float = 0.05) -> float | None:
    """Threads other than this one runnable right now (Linux /proc/loadavg's fourth field,
    averaged over ``samples``), or None where the kernel does not say."""
    counts = []
    for _ in range(samples):
        try:
            running = Path("/proc/loadavg").read_text().split()[3].split("/")[0]
        except (OSError, IndexError):
            return None
        counts.append(max(int(running) - 1, 0))
        time.sleep(every_s)
    return sum(counts) / len(counts)
