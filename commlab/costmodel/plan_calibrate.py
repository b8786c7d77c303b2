"""The planner's communication and executor costs: a micro-benchmark of a few seconds at plan time.

The bench predictor takes its per-message delay and per-action overhead from the timed run's own
calibration steps (:mod:`commlab.costmodel.pipeline_calibrate`); the planner has no run yet, so it measures
the same two terms once before it prices any plan, on the ranks it plans for (Gloo):

- the executor's per-action overhead and its per-message delay: a few steps of the real executor
  (1F1B, one tiny linear layer per rank, so compute is negligible and messages are a few bytes),
  read with the bench's own functions (:func:`calibrate.executor_overhead`,
  :func:`calibrate.comm_latency`). That delay is the message cost at zero bytes: ``alpha``.
- the per-byte cost ``beta``: the slope of a ping-pong between ranks 0 and 1 at the plans' real
  boundary sizes (one-way time = half the round trip), a least-squares line.

Both then enter the one costs type, :class:`~commlab.costmodel.costs.SystemCosts` (its
point-to-point line and per-action overhead), exactly as the bench's do. For a hybrid plan
(``--dp``), :func:`allreduce_table` adds the all-reduce table at the data-parallel world size:
``dist.all_reduce`` timed on that many Gloo ranks at the plans' bucket sizes.
"""

from __future__ import annotations

import math
import os
import statistics
import time
from collections.abc import Sequence
from typing import Any

from commlab.bench.alpha_beta import least_squares_line
from commlab.costmodel.costs import Overheads, PointToPoint, SystemCosts
from commlab.costmodel.pipeline import shared
from commlab.costmodel.pipeline_calibrate import comm_latency, executor_overhead


def measured(alpha: float = 0.0, beta: float = 0.0, overhead: float = 0.0) -> SystemCosts:
    """The costs this calibration measures: seconds per message (``alpha``), per byte (``beta``)
    and per executor action (``overhead``); zero: compute alone."""
    return SystemCosts(p2p=PointToPoint(alpha, beta), overheads=Overheads(action_s=overhead))


def fit_line(sizes: Sequence[float], seconds: Sequence[float]) -> tuple[float, float]:
    """Least-squares ``seconds = alpha + size * beta``; a negative slope (noise) is clamped to 0,
    and so is a negative intercept. Fewer than two distinct sizes: no slope, alpha the mean."""
    if len(sizes) != len(seconds) or not sizes:
        raise ValueError("fit_line needs as many times as sizes, at least one")
    _, slope = least_squares_line(sizes, seconds)
    beta = 0.0 if math.isnan(slope) else max(0.0, slope)
    # With the slope clamped, the line through the means is still the least-squares intercept for it.
    return max(0.0, statistics.fmean(seconds) - beta * statistics.fmean(sizes)), beta


def measure_rank(sizes: list[int], common: dict[str, Any]) -> dict[str, Any]:
    """On every rank (commlab.launch): ping-pong times per size (ranks 0 and 1), then the timelines
    of a few steps of the executor on a tiny model, as the bench records them."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    import commlab
    from commlab.pipeline.runtime.executor import PipelineExecutor
    from commlab.pipeline.runtime.stages import RankStages

    rt = commlab.Runtime.current()
    pingpong: dict[int, list[float]] = {}
    for size in sizes:
        buf = torch.empty(max(1, size // 4), dtype=torch.float32)
        for k in range(common["repeats"] + 1):
            dist.barrier()
            start = time.perf_counter()
            if rt.rank == 0:
                dist.send(buf, 1)
                dist.recv(buf, 1)
            elif rt.rank == 1:
                dist.recv(buf, 0)
                dist.send(buf, 0)
            if k:  # the first round allocates and connects
                pingpong.setdefault(size, []).append((time.perf_counter() - start) / 2)
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(rt.world_size)])
    stage = RankStages(model, [1] * rt.world_size)
    pipe = PipelineExecutor(stage, "1f1b", microbatches=4, loss_fn=F.mse_loss, track_memory=False, timeout=common["timeout"])
    x, y = torch.randn(8, 4), torch.randn(8, 4)
    calibration: dict[str, list] = {"timelines": [], "origins": []}
    for k in range(1 + common["steps"]):
        dist.barrier()
        start = time.perf_counter()
        pipe.step(x if stage.is_first else None, target=y if stage.is_last else None)
        if k:
            calibration["origins"].append(start)
            calibration["timelines"].append([(t.action.stage, t.action.kind, t.action.microbatch, pipe.started_at + t.start,
                                              pipe.started_at + t.end) for t in pipe.timeline])  # fmt: skip
    return {"rank": rt.rank, "pingpong": pingpong, **calibration}


def calibrate(ranks: int, sizes: Sequence[int], *, repeats: int = 10, steps: int = 5, timeout: float = 120.0) -> SystemCosts:
    """Measure :func:`measured`'s terms on ``ranks`` Gloo ranks; ``sizes``: the plans' boundary bytes."""
    import commlab  # commlab.launch imports torch: loaded only when calibrating

    if ranks < 2:
        return measured()
    sizes = sorted({64, *(int(s) for s in sizes if s > 0)})
    per_rank = commlab.launch(measure_rank, sizes, {"repeats": repeats, "steps": steps, "timeout": timeout},
                              world_size=ranks, backend="gloo", timeout=timeout)  # fmt: skip
    zero = next(r for r in per_rank if r["rank"] == 0)
    _, beta = fit_line(sizes, [statistics.median(zero["pingpong"][s]) for s in sizes])
    cores = os.cpu_count()  # ranks beyond the cores: their waits for a core are not overhead
    return measured(comm_latency(per_rank, ranks), beta, executor_overhead(per_rank, ranks, cores if shared(ranks, cores) else None))
