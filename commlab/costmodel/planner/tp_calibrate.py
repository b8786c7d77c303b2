"""The layout planner's calibration: shares profiled every rank at once, and collectives between compute.

Two effects a one-process profile and a from-the-barrier all-reduce miss, each measured once per
model on the ranks it plans for (Gloo), never on a run of a layout:

- ranks compute at once and share the host's caches and memory bandwidth (the pipeline planner
  times its stages every rank at once for the same reason): :func:`commlab.costmodel.planner.layout_search.co_profiles` runs
  :func:`~commlab.costmodel.planner.layout_search.split_profiles` on every rank together (each rank
  profiles rank 0's share over its own recording group: still no tensor-parallel run) and takes
  the median over ranks of each time;
- a tensor-parallel collective sits between two pieces of compute: each one waits for the later
  rank to arrive, and Gloo's transport threads share the cores with the compute. So the all-reduce
  table is measured between compute (:func:`between_compute_table`): every rank alternates a
  generic matrix product of ``gap`` seconds (the model's median compute between two collectives)
  with an all-reduce of each size; per size, the slowest rank's time per pair less its product alone.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Mapping, Sequence
from typing import Any

from commlab.costmodel.terms.uncertainty import overall_spread
from commlab.costmodel.terms.costs import CollectiveCost, cost_from_entry, fit_table


def _between_rank(sizes: list[int], common: dict[str, Any]) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    a = torch.randn(96, 96)
    t0 = time.perf_counter()
    for _ in range(50):
        a @ a
    per = (time.perf_counter() - t0) / 50
    k = max(1, round(common["gap"] / per))

    def compute() -> None:
        for _ in range(k):
            a @ a

    reps, out = common["reps"], {}
    for size in [0, *sizes]:
        buf = torch.zeros(max(1, size // 4))
        samples = []
        for _ in range(common["rounds"]):
            dist.barrier()
            start = time.perf_counter()
            for _ in range(reps):
                compute()
                if size:
                    dist.all_reduce(buf)
            samples.append((time.perf_counter() - start) / reps)
        out[size] = samples
    return out


def between_compute_table(world: int, sizes: Sequence[int], gap: float, *, reps: int = 20, rounds: int = 5,
                          timeout: float = 300.0) -> CollectiveCost:  # fmt: skip
    """The all-reduce table of ``world`` Gloo ranks between pieces of ``gap`` seconds of compute (see the module docstring)."""
    from commlab.costmodel.calibration.run import run_calibration

    sizes = sorted({int(s) for s in sizes if s > 0})
    common = {"gap": gap, "reps": reps, "rounds": rounds}
    run = run_calibration(_between_rank, sizes, common, world_size=world, backend="gloo", timeout=timeout,
                          spread=lambda rs: overall_spread(r[s] for r in rs for s in sizes))
    slowest = {s: [max(v) for v in zip(*(r[s] for r in run.results))] for s in [0, *sizes]}
    alone = statistics.median(slowest[0])
    seconds = [max(statistics.median(slowest[s]) - alone, 1e-7) for s in sizes]
    return cost_from_entry(fit_table(sizes, seconds))


def median_gap(profiles: Mapping[tuple, Any]) -> float:
    """The median compute between two tensor-parallel collectives over ``profiles`` (forward and backward)."""
    gaps = []
    for p in profiles.values():
        for times, passes in ((p.forward, p.forward_collectives), (p.backward, p.backward_collectives)):
            gaps += [t / len(c) for t, c in zip(times, passes) if c]
    return statistics.median(gaps) if gaps else 0.0
