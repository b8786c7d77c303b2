"""The pipeline benchmark: commlab's executor vs torch.distributed.pipelining, same model, same run.

Every configuration (schedule x micro-batches x balance x checkpointing) runs inside one launch:
commlab's step and torch's (ScheduleGPipe, Schedule1F1B, ScheduleInterleaved1F1B over
PipelineStage) alternate iteration by iteration on copies of the same seeded MLP and batch, so a
load change on a shared machine hits both. A step's time is the slowest rank's, measured from a
barrier. From commlab's own timeline (each action's compute interval) we get the measured bubble
(idle share of all ranks' time) and per-stage forward/backward times, which the simulator turns
into its predicted bubble (with the median measured message delay as ``comm``). The "replayed"
bubble feeds each step's own action times to the simulator: on a loaded machine compute times
vary from one micro-batch to the next, which a per-stage median cannot predict. Activation memory is the bytes saved for backward (saved-tensor hooks),
plus the CUDA allocator's peak on GPUs. torch has no checkpointing in its schedules, so the
reference runs only for ``checkpoint=never``. The predicted step time is calibrated on
``calibrate`` commlab steps run before the timed ones (:mod:`commlab.costmodel.calibration.pipeline`).
"""

from __future__ import annotations

import pickle
import shutil
import sys
from pathlib import Path
from typing import Any

import commlab
from commlab._atomic import write_via
from commlab.bench import pipeline_results as bench_results
from commlab.pipeline.schedule.registry import REGISTRY
from commlab.costmodel.calibration.pipeline import from_barrier, step_of, step_timeline
from commlab.runtime.threads import rank_threads
from commlab.runtime.timer import StartTime, WallClock, timed_rounds

COMMON_DEFAULTS = dict(depth=8, width=1024, batch=64, iters=10, warmup=3, virtual=2)


def measure_rank(configs: list[dict[str, Any]], common: dict[str, Any]) -> list[dict[str, Any]]:
    """Run every configuration on this rank (called by commlab.launch on each rank)."""
    rt = commlab.Runtime.current()
    out = []
    for k, cfg in enumerate(configs):
        out.append(_measure(rt, cfg, common))
        if common.get("partial"):  # each finished configuration on disk at once: an interrupt keeps it
            data = pickle.dumps(out[-1])
            write_via(Path(common["partial"]) / f"{k}-rank{rt.rank}.pkl", lambda tmp: Path(tmp).write_bytes(data))
    return out


def finished(partial: Path, configs: list, world: int) -> list[list[dict[str, Any]]]:
    """The per-rank results of the configurations every rank finished (in order, stopping at the
    first unfinished one), read from what :func:`measure_rank` wrote to ``partial``."""
    done = []
    for k in range(len(configs)):
        paths = [Path(partial) / f"{k}-rank{r}.pkl" for r in range(world)]
        if not all(p.exists() for p in paths):
            break
        done.append([pickle.loads(p.read_bytes()) for p in paths])
    return done


def balance(mode: str, depth: int, width: int, batch: int, stages: int, world_size: int) -> list[int]:
    """The benchmark MLP's balance, decided once in the parent so every rank splits the model the same way."""
    import torch  # loaded here: the CLI imports this module for its help text

    from commlab.models import mlp
    from commlab.pipeline.runtime.partition import balance_by_size, balance_by_time, partition

    torch.manual_seed(0)
    model = mlp(depth, width)
    if stages > len(model):
        raise ValueError(f"{world_size} ranks x {stages // world_size} stage(s) per rank = {stages} pipeline stages, but "
                         f"the MLP of --depth {depth} has only {len(model)} layers to split among them: lower "
                         "--world-size (or raise --depth)")
    if mode == "uniform":
        return partition([1.0] * len(model), stages)
    sample = torch.randn(batch, width)
    if mode != "time":
        return balance_by_size(model, sample, stages)
    with rank_threads(world_size):  # profiled with a rank's threads, not the parent's
        return balance_by_time(model, sample, stages, repeat=5)


def _measure(rt, cfg: dict[str, Any], common: dict[str, Any]) -> dict[str, Any]:
    import torch
    import torch.nn.functional as F

    from commlab.models import mlp
    from commlab.pipeline.runtime.executor import PipelineExecutor
    from commlab.pipeline.runtime.stages import RankStages

    def model():
        torch.manual_seed(0)
        return mlp(common["depth"], common["width"])

    gen = torch.Generator().manual_seed(1)
    x = torch.randn(common["batch"], common["width"], generator=gen).to(rt.device)
    y = torch.randint(0, 10, (common["batch"],), generator=gen).to(rt.device)
    ours_model = model()
    found = REGISTRY[cfg["schedule"]]
    placement = found.placement(rt.world_size, len(cfg["balance"]))
    stage = RankStages(ours_model, cfg["balance"], placement, device=rt.device)
    options = dict(microbatches=cfg["microbatches"], loss_fn=F.cross_entropy, checkpoint=cfg["checkpoint"],
                   timeout=common.get("timeout", 300.0))  # fmt: skip
    # Timing runs as a user would: no memory hooks, no per-action device synchronisation.
    ours = PipelineExecutor(stage, cfg["schedule"], track_memory=False, measure=False, **options)
    nets, steps = {"commlab": ours_model}, {"commlab": step_of(stage, ours, x, y)}
    if cfg["checkpoint"] == "never" and found.torch is not None:
        nets["torch"] = model()
        steps["torch"] = _torch_step(nets["torch"], cfg, rt, x, y)
    cuda = rt.device.type == "cuda"
    # absolute perf_counter starts (one clock for all local ranks) and wall seconds, GPU work included
    meters = {"origins": StartTime(rt.device), "seconds": WallClock(rt.device)}
    # Calibration steps first (commlab alone, after one warm-up step): the predictor's costs come
    # from these, never from the timed steps it is checked against.
    calibration: dict[str, list] = {"timelines": []}
    calibrated = timed_rounds({"commlab": steps["commlab"]}, common.get("calibrate", 3), 1, meters=meters,
                              before=lambda _n: from_barrier(ours_model),
                              after=lambda _n, timed: timed and calibration["timelines"].append(step_timeline(ours)))
    calibration["origins"] = calibrated["origins"]["commlab"]
    timelines, cuda_peak, base = [], None, 0

    def before(name: str) -> None:
        nonlocal base
        from_barrier(nets[name])
        if cuda:
            torch.cuda.reset_peak_memory_stats(rt.device)
            base = torch.cuda.memory_allocated(rt.device)

    def after(name: str, timed: bool) -> None:
        nonlocal cuda_peak
        if timed and name == "commlab":
            timelines.append(step_timeline(ours))
            if cuda:
                cuda_peak = torch.cuda.max_memory_allocated(rt.device) - base

    # Iterations alternate between commlab and torch (neither always goes first).
    samples = timed_rounds(steps, common["iters"], common["warmup"], meters=meters, before=before, after=after)
    times, origins = samples["seconds"], samples["origins"]["commlab"]
    # Memory from one more, untimed step with the accounting on.
    counted = PipelineExecutor(stage, cfg["schedule"], **options)
    step_of(stage, counted, x, y)()
    ours_model.zero_grad(set_to_none=True)
    return {"rank": rt.rank, "times": times, "timelines": timelines, "origins": origins, "cuda_peak": cuda_peak, "calibration": calibration,
            "saved_bytes": dict(counted.peak_saved_bytes), "rank_peak_bytes": counted.memory.peak}  # fmt: skip


def _torch_step(net, cfg: dict[str, Any], rt, x, y):
    """The same split under torch.distributed.pipelining; returns a closure running one step."""
    import torch.nn.functional as F

    from torch.distributed.pipelining import PipelineStage, schedules

    from commlab.pipeline.runtime.partition import split

    found = REGISTRY[cfg["schedule"]]
    parts = split(net, cfg["balance"])
    p, total = rt.world_size, len(parts)
    placement = found.placement(p, total)
    stages = [PipelineStage(parts[s].to(rt.device), s, total, rt.device) for s in range(total) if placement[s] == rt.rank]
    m = cfg["microbatches"]
    kind = getattr(schedules, found.torch)
    if issubclass(kind, schedules.PipelineScheduleSingle):
        schedule = kind(stages[0], m, loss_fn=F.cross_entropy)
    else:
        schedule = kind(stages, m, loss_fn=F.cross_entropy)
    first, last = rt.rank == placement[0], rt.rank == placement[-1]

    def step():
        args = (x,) if first else ()
        if last:
            schedule.step(*args, target=y, losses=[], return_outputs=False)
        else:
            schedule.step(*args, return_outputs=False)

    return step


def run(run_dir: Path, configs: list, common: dict, world_size: int, backend: str, no_figures: bool, command: str) -> None:
    """Launch the benchmark and write its results; on Ctrl-C (or SIGTERM) keep every configuration
    that every rank finished, say where, and exit 130."""
    from commlab.runtime.launch import sigterm_as_interrupt  # torch: loaded when a run starts, as above
    from commlab.runtime.metadata import environment

    partial = run_dir / ".partial"  # each rank writes each finished configuration here
    partial.mkdir(parents=True, exist_ok=True)
    meta = {"command": command, **common, "backend": backend, "world_size": world_size, "environment": environment()}
    try:
        with sigterm_as_interrupt():  # a batch system's SIGTERM keeps the rows like Ctrl-C
            per_rank = commlab.launch(measure_rank, configs, {**common, "partial": str(partial)}, world_size=world_size,
                                      backend=backend, timeout=common["timeout"])  # fmt: skip
    except BaseException as stop:  # interrupted, or a rank failed: keep the configurations every rank finished
        done = finished(partial, configs, world_size)
        if done or isinstance(stop, KeyboardInterrupt):
            bench_results.write(run_dir, *bench_results.rows(configs, done, world_size, common["batch"], backend),
                                {**meta, "interrupted": True, "configurations_measured": len(done)})  # fmt: skip
        shutil.rmtree(partial, ignore_errors=True)
        if not isinstance(stop, KeyboardInterrupt):
            raise
        print(f"interrupted: {len(done)} of {len(configs)} configurations measured, their rows kept in {run_dir}",
              file=sys.stderr)  # fmt: skip
        raise SystemExit(getattr(stop, "exit_code", 130)) from None
    shutil.rmtree(partial, ignore_errors=True)
    per_config = [[r[k] for r in per_rank] for k in range(len(configs))]
    summary, stages, timeline = bench_results.rows(configs, per_config, world_size, common["batch"], backend)
    bench_results.write(run_dir, summary, stages, timeline, meta)
    print("\n".join(bench_results.table(summary, stages)))
    if not no_figures:
        from commlab.bench.pipeline_figures import draw_all  # matplotlib: only when drawing

        for path in draw_all(run_dir):
            print(f"wrote {path}")
