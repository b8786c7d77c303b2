"""The planner's communication and executor costs: a micro-benchmark of a few seconds at plan time.

The bench predictor takes its per-message delay and per-action overhead from the timed run's own
calibration steps (:mod:`commlab.costmodel.calibration.pipeline`); the planner has no run yet, so it measures
the same two terms once before it prices any plan, on the ranks it plans for (Gloo):

- the executor's per-action overhead and its per-message delay: a few steps of the real executor
  (1F1B, one tiny linear layer per rank, so compute is negligible and messages are a few bytes),
  read with the bench's own functions (:func:`calibrate.executor_overhead`,
  :func:`calibrate.comm_latency`). That delay is the message cost at zero bytes: ``alpha``.
- the per-byte cost ``beta``: the slope of a ping-pong between ranks 0 and 1 at the plans' real
  boundary sizes (one-way time = half the round trip), a least-squares line.

- per (schedule, stages per rank) the plans use, the executor's overhead per action and the
  stretch of compute inside the pipeline, from the model's own runs at a micro-batch count no
  plan uses (:mod:`commlab.costmodel.planner.offgrid`).

Both then enter the one costs type, :class:`~commlab.costmodel.terms.costs.SystemCosts` (its
point-to-point line and per-action overhead), exactly as the bench's do. For a hybrid plan
(``--dp``), :func:`allreduce_table` measures the all-reduce table at the data-parallel world
size (``dist.all_reduce`` on that many Gloo ranks at the plans' bucket sizes, what commlab's DDP
runs with its default ``algorithm="native"``); without calibration, :func:`calibrated_line` takes
the alpha-beta line of a DDP calibration (``commlab calibrate``) of this machine at that world size.
"""

from __future__ import annotations

import math
import os
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from commlab.costmodel.terms.alpha_beta import least_squares_line
from commlab.costmodel.terms.uncertainty import Steadiness, overall_spread
from commlab.costmodel.calibration import cache
from commlab.costmodel.calibration.driver import DEFAULT_CALIBRATION, table_sizes
from commlab.costmodel.calibration.run import run_calibration
from commlab.costmodel.terms.costs import (
    CollectiveCost,
    Overheads,
    PointToPoint,
    SystemCosts,
    cost_from_entry,
    fit_table,
)
from commlab.costmodel.lowering.pipeline import shared
from commlab.costmodel.calibration.pipeline import comm_latency, executor_overhead
from commlab.costmodel.planner.offgrid import executor_timelines, profiled_runs, run_rank, schedule_costs
from commlab.runtime.timer import time_sizes


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
    """On every rank (commlab.launch): ping-pong times per size (ranks 0 and 1), the timelines of a
    few steps of the executor on a tiny model, as the bench records them, with ``common["stage_times"]``
    the model's stages timed on every rank at once (:func:`commlab.costmodel.planner.model.rank_stage_times`),
    and with ``common["offgrid"]`` its own runs off the plans' grid (:func:`commlab.costmodel.planner.offgrid.run_rank`)."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    import commlab
    from commlab._malloc import keep_freed_memory
    from commlab.costmodel.planner.model import rank_stage_times
    from commlab.pipeline.runtime.stages import RankStages

    rt = commlab.Runtime.current()
    keep_freed_memory()  # as the plans are measured (commlab.validation.planner.measure_rank)

    def round_trip(size: int):
        buf = torch.empty(max(1, size // 4), dtype=torch.float32)

        def call() -> None:  # rank 0 sends first, rank 1 answers; the others only meet the barriers
            if rt.rank == 0:
                dist.send(buf, 1)
                dist.recv(buf, 1)
            elif rt.rank == 1:
                dist.recv(buf, 0)
                dist.send(buf, 0)

        return call

    # one way: half the round trip
    pingpong = {size: [t / 2 for t in samples]
                for size, samples in zip(sizes, time_sizes(round_trip, sizes, common["repeats"]))}
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(rt.world_size)])
    calibration = executor_timelines(model, RankStages(model, [1] * rt.world_size), "1f1b", 4, torch.randn(8, 4),
                                     torch.randn(8, 4), F.mse_loss, common)  # fmt: skip
    stages = rank_stage_times(common["stage_times"]) if common.get("stage_times") else {}
    own = run_rank({**common, "steps": common["offgrid_steps"]}) if common.get("offgrid") else {}
    return {"rank": rt.rank, "pingpong": pingpong, **calibration, "stage_times": stages, "offgrid": own}


def calibrate(ranks: int, sizes: Sequence[int], *, repeats: int = 10, steps: int = 5, timeout: float = 120.0,
              stages: Mapping | None = None, offgrid: Mapping | None = None) -> tuple[SystemCosts, list[dict[str, Any]], Steadiness]:  # fmt: skip
    """Measure :func:`measured`'s terms on ``ranks`` Gloo ranks (``sizes``: the plans' boundary
    bytes), with ``stages`` (:func:`~commlab.costmodel.planner.model.rank_stage_times`'s spec) the
    model's stages, with ``offgrid`` (:func:`~commlab.costmodel.planner.offgrid.run_rank`'s) its
    runs off the grid, in one calibration run (commlab/costmodel/calibration/run.py); returns the
    costs, every rank's measurements, and how steady the ping-pongs were."""
    sizes = sorted({64, *(int(s) for s in sizes if s > 0)})
    common = {"repeats": repeats, "steps": steps, "timeout": timeout, "offgrid_steps": 2 * steps, "stage_times": stages,
              "offgrid": offgrid}  # fmt: skip
    # the ranks that ping-pong (0 and 1; the others only meet the barriers)
    run = run_calibration(measure_rank, sizes, common, world_size=ranks, backend="gloo", timeout=timeout,
                          spread=lambda rs: overall_spread(r["pingpong"][s] for r in rs if r["rank"] < 2 for s in sizes))
    per_rank = run.results
    zero = next(r for r in per_rank if r["rank"] == 0)
    _, beta = fit_line(sizes, [statistics.median(zero["pingpong"][s]) for s in sizes])
    system = measured(comm_latency(per_rank, ranks), beta, executor_overhead(per_rank, ranks, _share(ranks)))
    return system, per_rank, run.steadiness


def _share(ranks: int) -> int | None:
    cores = os.cpu_count()  # ranks beyond the cores: their waits for a core are not overhead
    return cores if shared(ranks, cores) else None


def plan_costs(profiles: Mapping[int, Any], ranks: int, dp: int = 1, *, measure: bool = True, timeout: float = 120.0,
               echo: Callable[[str], None] = lambda _l: None, stages: Mapping | None = None,
               offgrid: Mapping | None = None) -> tuple[SystemCosts, dict, dict]:  # fmt: skip
    """The planner's costs for these layer profiles (:class:`commlab.costmodel.planner.plan.LayerProfile`,
    one per micro-batch count): :func:`calibrate` on ``ranks`` ranks when ``measure`` (else zero),
    and with ``dp`` > 1 the all-reduce at ``dp`` ranks (:func:`with_allreduce`); ``echo`` says
    what. With ``stages``, the profiles' stages are timed there, every rank at once
    (:func:`~commlab.costmodel.planner.stages.co_run`); with ``offgrid`` (the runs' spec,
    :func:`commlab.costmodel.planner.offgrid.calibration_runs`; ``profiles`` has their count), each
    schedule's overhead per action and compute stretch (:func:`~commlab.costmodel.planner.offgrid.schedule_costs`).
    Returns the costs, those per (schedule, stages per rank), and the profiles."""
    from commlab.costmodel.planner.stages import co_run, with_stages

    profiles = dict(profiles)
    system, overheads = measured(), {}
    if measure and ranks > 1:
        # Every boundary a plan can have is some layer's output at some micro-batch size.
        system, per_rank, steadiness = calibrate(ranks, sorted({int(b) for p in profiles.values() for b in p.output}),
                                                 timeout=timeout, stages=stages, offgrid=offgrid)  # fmt: skip
        if stages:
            profiles = with_stages(profiles, co_run([r["stage_times"] for r in per_rank]))
        echo(f"calibrated on {ranks} Gloo ranks: executor overhead {system.overheads.action_s * 1e6:.0f} us/action, message "
             f"{system.p2p.alpha_s * 1e6:.0f} us + {system.p2p.beta_s_per_byte * 1e9:.3f} ns/byte"
             + (", every stage timed on every rank at once" if stages else "") + f"; {steadiness.describe()}")  # fmt: skip
        if offgrid:
            count = offgrid["microbatches"]
            alone = profiled_runs(profiles[count], offgrid, ranks)
            overheads = schedule_costs(per_rank, ranks, alone, count, system, _share(ranks))
            echo(f"per schedule, from the model's own runs at {count} micro-batches (a count no plan uses), "
                 "executor overhead per action and compute stretch: "
                 + ", ".join(f"{n} v={v} " + " ".join(f"{mode} {o * 1e6:.0f} us x{x:.2f}" for mode, (o, x) in by_mode.items())
                             for (n, v), by_mode in overheads.items()))  # fmt: skip
    if dp > 1:
        system, source = with_allreduce(system, dp, int(sum(next(iter(profiles.values())).params)), measure=measure, timeout=timeout)
        echo(f"all-reduce {source}")
    return system, overheads, profiles


def allreduce_rank(sizes: list[int], common: dict[str, Any]) -> dict[str, Any]:
    """On every rank (commlab.launch): ``dist.all_reduce`` seconds per size, one per repeat, each from a barrier."""
    import torch
    import torch.distributed as dist

    def all_reduce(size: int):
        buf = torch.zeros(max(1, size // 4), dtype=torch.float32)
        return lambda: dist.all_reduce(buf)

    return {"times": dict(zip(sizes, time_sizes(all_reduce, sizes, common["repeats"])))}


def allreduce_table(world: int, sizes: Sequence[int], *, repeats: int = 5,
                    timeout: float = 120.0) -> tuple[CollectiveCost, Steadiness]:  # fmt: skip
    """The all-reduce table of ``world`` Gloo ranks at ``sizes`` bytes (a few seconds): per size,
    the median over repeats of the slowest rank's time (a collective ends when its last rank does);
    and how steady the calibration run (commlab/costmodel/calibration/run.py) was."""
    sizes = sorted({int(s) for s in sizes if s > 0})
    if len(sizes) < 2:
        sizes = sorted({*sizes, 4, 1 << 20})
    run = run_calibration(allreduce_rank, sizes, {"repeats": repeats}, world_size=world, backend="gloo", timeout=timeout,
                          spread=lambda rs: overall_spread(r["times"][s] for r in rs for s in sizes))
    seconds = [statistics.median(max(ts) for ts in zip(*(r["times"][s] for r in run.results))) for s in sizes]
    return cost_from_entry(fit_table(sizes, seconds)), run.steadiness


def calibrated_line(world: int, algorithm: str = "native", path: Path | None = None) -> CollectiveCost | None:
    """The alpha-beta line of the newest DDP calibration (``commlab calibrate``) of this machine with
    Gloo at ``world`` ranks that measured ``algorithm``; None when the calibration file has none."""
    try:
        entries = cache.read_file(path or DEFAULT_CALIBRATION).values()
    except (OSError, ValueError):
        return None
    found = [e for e in entries if e["key"].get("machine") == cache.machine_id() and e["key"].get("backend") == "gloo"
             and e["key"].get("world_size") == world and algorithm in e.get("collectives", {})]  # fmt: skip
    for entry in sorted(found, key=lambda e: e.get("created", 0.0), reverse=True):
        line = entry["collectives"][algorithm]
        alpha, beta = float(line.get("alpha_s", math.nan)), float(line.get("beta_bytes_per_s", math.nan))
        if math.isfinite(alpha) and math.isfinite(beta) and beta > 0:
            return CollectiveCost.line(max(alpha, 0.0), beta)
    return None


def with_allreduce(system: SystemCosts, world: int, total_bytes: int, *, measure: bool = True,
                   timeout: float = 120.0) -> tuple[SystemCosts, str]:  # fmt: skip
    """``system`` with an all-reduce table at ``world`` ranks, and where it came from: measured
    (:func:`allreduce_table` at the bucket sizes that can occur up to ``total_bytes``), or with
    ``measure=False`` the DDP calibration's line (:func:`calibrated_line`; ValueError if none)."""
    if measure:
        cost, steadiness = allreduce_table(world, table_sizes(total_bytes), timeout=timeout)
        source = f"measured on {world} Gloo ranks ({len(cost.sizes)} sizes; {steadiness.describe()})"
    else:
        cost = calibrated_line(world)
        if cost is None:
            raise ValueError(f"no DDP calibration at world size {world} on this machine")
        source = f"from the alpha-beta line of the DDP calibration at world size {world}"
    source += f": {cost(total_bytes) * 1e3:.2f} ms for all {total_bytes / 2**20:.2f} MiB of gradients"
    return replace(system, collectives={**system.collectives, ("allreduce", "native", world): cost}), source
