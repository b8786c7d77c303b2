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
``calibrate`` commlab steps run before the timed ones (:mod:`commlab.pipeline.calibrate`).
"""

from __future__ import annotations

import os
import statistics
import time
from typing import Any

from commlab.pipeline.calibrate import aligned, comm_latency, idle_breakdown, predicted_step, stage_times

COMMON_DEFAULTS = dict(depth=8, width=1024, batch=64, iters=10, warmup=3, virtual=2)


def measure_rank(configs: list[dict[str, Any]], common: dict[str, Any]) -> list[dict[str, Any]]:
    """Run every configuration on this rank (called by commlab.launch on each rank)."""
    import commlab

    rt = commlab.Runtime.current()
    return [_measure(rt, cfg, common) for cfg in configs]


def _measure(rt, cfg: dict[str, Any], common: dict[str, Any]) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from commlab.models import mlp
    from commlab.pipeline.executor import PipelineSchedule
    from commlab.pipeline.schedules import REGISTRY
    from commlab.pipeline.stage import Stage

    def model():
        torch.manual_seed(0)
        return mlp(common["depth"], common["width"])

    gen = torch.Generator().manual_seed(1)
    x = torch.randn(common["batch"], common["width"], generator=gen).to(rt.device)
    y = torch.randint(0, 10, (common["batch"],), generator=gen).to(rt.device)
    ours_model = model()
    found = REGISTRY[cfg["schedule"]]
    placement = found.placement(rt.world_size, len(cfg["balance"]))
    stage = Stage(ours_model, cfg["balance"], placement, device=rt.device)
    options = dict(microbatches=cfg["microbatches"], loss_fn=F.cross_entropy, checkpoint=cfg["checkpoint"],
                   timeout=common.get("timeout", 300.0))  # fmt: skip
    # Timing runs as a user would: no memory hooks, no per-action device synchronisation.
    ours = PipelineSchedule(stage, cfg["schedule"], track_memory=False, measure=False, **options)
    runs = {"commlab": (ours_model, lambda: ours.step(x if stage.is_first else None, target=y if stage.is_last else None))}
    if cfg["checkpoint"] == "never" and found.torch is not None:
        ref_model = model()
        runs["torch"] = (ref_model, _torch_step(ref_model, cfg, rt, x, y))
    cuda = rt.device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    times: dict[str, list[float]] = {name: [] for name in runs}
    # Calibration steps first (commlab alone, after one warm-up step): the predictor's costs come
    # from these, never from the timed steps it is checked against.
    calibration: dict[str, list] = {"timelines": [], "origins": []}
    for i in range(1 + common.get("calibrate", 3)):
        ours_model.zero_grad(set_to_none=False)
        dist.barrier()
        sync()
        start = time.perf_counter()
        runs["commlab"][1]()
        sync()
        if i:
            calibration["origins"].append(start)
            calibration["timelines"].append([(t.action.stage, t.action.kind, t.action.microbatch, ours.started_at + t.start,
                                              ours.started_at + t.end) for t in ours.timeline])  # fmt: skip
    timelines, origins, cuda_peak = [], [], None
    for i in range(common["warmup"] + common["iters"]):
        for name in list(runs) if i % 2 == 0 else list(runs)[::-1]:  # neither always goes first
            net, step = runs[name]
            net.zero_grad(set_to_none=False)
            dist.barrier()
            sync()
            if cuda:
                torch.cuda.reset_peak_memory_stats(rt.device)
                base = torch.cuda.memory_allocated(rt.device)
            start = time.perf_counter()
            step()
            sync()
            elapsed = time.perf_counter() - start
            if i < common["warmup"]:
                continue
            times[name].append(elapsed)
            if name == "commlab":  # absolute perf_counter times: one clock for all local ranks
                at = ours.started_at
                timelines.append([(t.action.stage, t.action.kind, t.action.microbatch, at + t.start, at + t.end) for t in ours.timeline])
                origins.append(start)
                if cuda:
                    cuda_peak = torch.cuda.max_memory_allocated(rt.device) - base
    # Memory from one more, untimed step with the accounting on.
    counted = PipelineSchedule(stage, cfg["schedule"], **options)
    counted.step(x if stage.is_first else None, target=y if stage.is_last else None)
    ours_model.zero_grad(set_to_none=True)
    return {"rank": rt.rank, "times": times, "timelines": timelines, "origins": origins, "cuda_peak": cuda_peak, "calibration": calibration,
            "saved_bytes": dict(counted.peak_saved_bytes), "rank_peak_bytes": counted.memory.peak}  # fmt: skip


def _torch_step(net, cfg: dict[str, Any], rt, x, y):
    """The same split under torch.distributed.pipelining; returns a closure running one step."""
    import torch.nn.functional as F

    from commlab.pipeline.schedules import REGISTRY
    from torch.distributed.pipelining import PipelineStage, schedules

    from commlab.pipeline.partition import split

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


def summarise(cfg: dict[str, Any], per_rank: list[dict[str, Any]], world: int, batch: int, backend: str = "gloo") -> dict[str, Any]:
    """One row: medians of the slowest rank's step, ratio to torch, measured vs simulated bubble."""
    from commlab.pipeline.schedules import Action, build
    from commlab.pipeline.simulate import bubble_formula, simulate

    slowest = {name: [max(ts) for ts in zip(*(r["times"][name] for r in per_rank))] for name in per_rank[0]["times"]}
    row: dict[str, Any] = {**_columns(cfg)}
    ours = statistics.median(slowest["commlab"])
    row.update(commlab_s=ours, commlab_samples_per_s=batch / ours)
    if "torch" in slowest:
        theirs = statistics.median(slowest["torch"])
        row.update(torch_s=theirs, torch_samples_per_s=batch / theirs, ratio=ours / theirs,
                   paired_ratio=statistics.median(a / b for a, b in zip(slowest["commlab"], slowest["torch"])))  # fmt: skip
    measured, waiting, ready = [], [], []
    fwd, bwd = stage_times(per_rank)
    for k, step_time in enumerate(slowest["commlab"]):
        busy = sum(end - start for r in per_rank for (*_, start, end) in r["timelines"][k])
        measured.append(1.0 - busy / (world * step_time))
        w, ready_k = idle_breakdown(aligned(per_rank, k), len(fwd), step_time)
        waiting.append(w / (world * step_time))
        ready.append(ready_k / (world * step_time))
    actions = build(cfg["schedule"], world, cfg["microbatches"], cfg["virtual"])
    comm = comm_latency(per_rank, len(fwd))
    replayed = []
    for k in range(len(measured)):
        own = {Action(s, kind, i): end - start for r in per_rank for s, kind, i, start, end in r["timelines"][k]}
        replayed.append(simulate(actions, fwd, bwd, 0.0, own).bubble)
    calibration = [{"rank": r["rank"], **r["calibration"]} for r in per_rank]  # steps run before the timed ones
    # Ranks beyond the machine's cores share them (summarise runs on the machine that measured).
    row.update(predicted_s=predicted_step(cfg, calibration, actions, world, len(fwd), os.cpu_count(), lookahead=backend != "nccl"))
    row["prediction_error"] = row["predicted_s"] / ours - 1.0
    row.update(bubble_replayed=statistics.median(replayed), idle_waiting=statistics.median(waiting),
               idle_data_ready=statistics.median(ready), bubble_measured=statistics.median(measured), bubble_simulated=simulate(actions, fwd, bwd, comm).bubble,
               bubble_simulated_no_comm=simulate(actions, fwd, bwd).bubble, comm_latency_s=comm,
               bubble_formula=bubble_formula(world, cfg["microbatches"], cfg["virtual"]))  # fmt: skip
    return row


def stage_rows(cfg: dict[str, Any], per_rank: list[dict[str, Any]]) -> list[dict[str, Any]]:
    fwd, bwd = stage_times(per_rank)
    rows = []
    for r in per_rank:
        for stage, nbytes in r["saved_bytes"].items():
            rows.append({**_columns(cfg), "rank": r["rank"], "stage": stage, "saved_bytes": nbytes,
                         "rank_peak_bytes": r.get("rank_peak_bytes"),
                         "cuda_peak_bytes": r["cuda_peak"], "forward_s": fwd[stage], "backward_s": bwd[stage]})  # fmt: skip
    return rows


def timeline_rows(cfg: dict[str, Any], per_rank: list[dict[str, Any]], world: int) -> list[dict[str, Any]]:
    """The median iteration's measured timeline and the simulator's, both in seconds."""
    from commlab.pipeline.schedules import build
    from commlab.pipeline.simulate import simulate

    steps = [max(r["times"]["commlab"][k] for r in per_rank) for k in range(len(per_rank[0]["timelines"]))]
    k = sorted(range(len(steps)), key=steps.__getitem__)[len(steps) // 2]
    rows = [{**_columns(cfg), "source": "measured", "rank": r, "stage": s, "kind": kind, "microbatch": i,
             "start": start, "end": end} for r, acts in aligned(per_rank, k).items() for s, kind, i, start, end in acts]  # fmt: skip
    fwd, bwd = stage_times(per_rank)
    sim = simulate(build(cfg["schedule"], world, cfg["microbatches"], cfg["virtual"]), fwd, bwd, comm_latency(per_rank, len(fwd)))
    rows += [{**_columns(cfg), "source": "simulated", "rank": t.rank, "stage": t.action.stage, "kind": t.action.kind,
              "microbatch": t.action.microbatch, "start": t.start, "end": t.end} for t in sim.timeline]  # fmt: skip
    return rows


def _columns(cfg: dict[str, Any]) -> dict[str, Any]:
    return {"config": cfg["config"], "schedule": cfg["schedule"], "microbatches": cfg["microbatches"],
            "balance_mode": cfg["balance_mode"], "balance": "-".join(map(str, cfg["balance"])),
            "checkpoint": cfg["checkpoint"], "virtual": cfg["virtual"]}  # fmt: skip
