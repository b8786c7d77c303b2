"""Co-run turns: how much one piece of a rank's work stretches when every rank runs it at once.

Ranks on one host share its cores' caches and its memory bandwidth. The model's matrix products
are compute-bound and stretch a little (about 1.1-1.2 here); the optimizer step and the bucket
write-back stream memory and stretch more (the SGD step of a 62 MiB model took 6.4 ms on one
rank and 11-13 ms in the two-rank runs, 2026-11). So each kind of work gets its own factor, measured
the same way: :func:`turns` alternates rank 0 alone with every rank together, and the driver takes
the quickest together over the quickest alone
(:func:`commlab.costmodel.calibration.driver.corun_factor`).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from commlab.costmodel.calibration.devicetime import Clock, timed
from commlab.runs.optimizers import DEFAULT as DEFAULT_OPTIMIZER, build_optimizer


def turns(step: Callable[[], Any], clock: Clock, reps: int,
          prepare: Callable[[], Any] | None = None) -> dict[str, Any]:
    """Rank 0 timing ``step`` alone, then every rank timing it at once, in turns, each from a
    barrier. ``prepare`` (untimed) runs before each timed ``step`` on the ranks about to time it:
    the optimizer needs fresh gradients, and preparing only there keeps the idle ranks' memory
    as it was (their gradients freed, as in a step).

    Every sample is kept: other jobs on the machine only ever add time, and a burst of theirs
    hits some turns and not others (a calibration once read 2.0 where the measured steps said 1.2)."""
    rank = dist.get_rank()
    alone, together = [], []
    for _ in range(max(reps, 9)):  # each turn is one step or two: cheap
        if rank == 0 and prepare is not None:
            prepare()
        dist.barrier()
        if rank == 0:
            alone.append(timed(clock, step))
        if prepare is not None:
            prepare()
        dist.barrier()
        together.append(timed(clock, step))
    return {"alone_s": float(statistics.median(alone)) if alone else 0.0,
            "together_s": float(statistics.median(together)), "alone_samples": alone, "together_samples": together}


def optimizer_turns(model: torch.nn.Module, forward_backward: Callable[[], Any], clock: Clock,
                    reps: int, optimizer: str = DEFAULT_OPTIMIZER) -> dict[str, Any]:
    """The optimizer step as the profile and the measured runs time it (commlab/sweep/worker.py):
    the configuration's optimizer's step and ``zero_grad(set_to_none=True)``, which frees the
    gradients (a gradient over glibc's mmap threshold is unmapped there), after an untimed
    forward + backward that made them. One untimed step first: Adam allocates its state there,
    as a run does in its warm-up."""
    step_with = build_optimizer(optimizer, [p for p in model.parameters() if p.requires_grad])

    def step() -> None:
        step_with.step()
        step_with.zero_grad(set_to_none=True)

    forward_backward()
    step()  # untimed: Adam allocates its state on the first step, which no measured step pays
    return turns(step, clock, reps, prepare=forward_backward)


def copy_turns(nbytes: int, clock: Clock, reps: int) -> dict[str, Any]:
    """The write-back's kind of work: copying ``nbytes`` (the model's gradients, so that caches do
    not hold them) from one buffer into another, as DDP copies reduced buckets into ``.grad``."""
    src, dst = (torch.ones(max(nbytes // 4, 1), dtype=torch.float32) for _ in range(2))
    return {**turns(lambda: dst.copy_(src), clock, reps), "nbytes": nbytes}
