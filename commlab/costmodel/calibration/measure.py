"""The rank side of calibration: small measurements that never run a multi-rank DDP iteration.

:func:`calibrate_rank` runs on every rank of one launch at the world size being calibrated:

1. the DDP loop itself at world size 1, on every rank at once (each rank its own one-rank process
   group, only rank 0's times kept): forward, each parameter's gradient-ready time in backward
   order (taken after DDP's own hook has copied it into its bucket, so the copy-in is included),
   the no_sync micro-batch, the optimizer (the configuration's: commlab/runs/optimizers.py), the
   write-back per byte (DDP's own write-back span), and, from two bucket caps with overlap off, the
   reducer's fixed cost per bucket. The DDP loop profiles better than the bare model: the
   gradients are copied from memory not in cache, and the allocator state is a DDP process's (an
   early prototype: the bare model came out ~40% fast on overlap-on configurations). Every rank
   runs it because ranks on one host share its caches and memory bandwidth, and a DDP rank's
   working set (parameters, gradients, buckets: three times the model) streams through them: with
   the other rank idle, the held-out wide-head model's forward took 11-12.6 ms and its SGD step
   5-7.7 ms, beside every rank's own DDP loop 14-18 ms and 9-10 ms, as in its two-rank DDP steps
   (13-19 and 10-13 ms; docs/measurements.md, 2026-11-27). A factor from two ranks running the
   bare model at once read 1.0-1.06 there: the bare model's working set is a third of DDP's;
2. the all-reduce of every algorithm over the given sizes: on the CPU each call from a barrier,
   on a GPU in batches queued back to back (devicetime.py's :func:`collective_timer`);
3. compute/communication interference: the model's forward+backward and one all-reduce of about
   the same duration, alone and started together (-> kc, km of the fluid model);
4. the same interference for a memory copy (a bucket's write-back) against each algorithm's
   all-reduce (commlab/costmodel/calibration/queueing.py);
5. on Gloo, the native all-reduce's queue: at every table size, about the model's bytes of
   buffers issued at once, as DDP hands its buckets over with overlap off (Gloo's process group
   runs two collectives at once on its two worker threads; commlab's p2p algorithms run one at
   a time on the group's worker): commlab/costmodel/calibration/queueing.py.

On NCCL every step runs on the rank's GPU and is timed with CUDA events (the device and clock of
commlab/costmodel/calibration/devicetime.py), step 2 in queued batches (the two differences from the
CPU path), and the rank reports the CUDA caching allocator's state after measuring.
"""

from __future__ import annotations

import resource
import statistics
from typing import Any

import torch
import torch.distributed as dist

import commlab
from commlab import collectives
from commlab._malloc import keep_freed_memory
from commlab.costmodel.calibration.devicetime import (
    allocator_state,
    calibration_device,
    clock_for,
    collective_timer,
    timed,
    to_device,
)
from commlab.costmodel.calibration.queueing import alone_and_together, copy_contention, queued
from commlab.costmodel.calibration.sharded import activation_bytes, fresh_memory, time_hybrid, time_sharded
from commlab.models import build_workload
from commlab.runs.optimizers import DEFAULT as DEFAULT_OPTIMIZER, build_optimizer
from commlab.runtime.timer import time_sizes, timed_steps


def calibrate_rank(spec: dict[str, Any]) -> dict[str, Any]:
    """On every rank of the calibration's launch (with its threads, commlab/costmodel/calibration/run.py):
    steps 1-5 above."""
    # glibc's heap thresholds fixed before anything is allocated, as in every measured run
    # (commlab/sweep/worker.py): which allocations fault must be the same here and there.
    keep_freed_memory()
    rank, world = dist.get_rank(), dist.get_world_size()
    solo = [dist.new_group([r]) for r in range(world)]  # every rank must create every group
    device = calibration_device(dist.get_backend())
    spec = {**spec, "device": str(device)}
    out: dict[str, Any] = {"rank": rank, "threads": torch.get_num_threads(), "device": str(device)}
    workload = build_workload(spec["model"], **spec["model_kwargs"])
    gen = torch.Generator().manual_seed(1000 + rank)
    batch = to_device(workload.make_batch(spec["batch_per_rank"], gen), device)
    dist.barrier()  # every rank starts its own one-rank DDP loop together (step 1)
    profile = _profile_ddp(spec, workload.loss_fn, batch, solo[rank])
    if rank == 0:
        out["ddp"] = profile
    dist.barrier()
    times = {a: _time_collective(a, spec["sizes"], spec["iters"], device) for a in spec["algorithms"]}
    out["collectives"] = {a: medians for a, (medians, _) in times.items()}
    out["collective_samples"] = {a: samples for a, (_, samples) in times.items()}  # for the spread
    model = _fresh_model(spec)
    total = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    if spec.get("sharded_algorithms"):  # the sharded collectives' tables and the activations' bytes
        out["sharded"] = time_sharded(spec["sharded_algorithms"], spec["sizes"], spec["iters"], device)
        out["hybrid"] = time_hybrid(spec["sharded_algorithms"], spec["sizes"], spec["iters"], device)
        out["activation_bytes"] = activation_bytes(model, workload.loss_fn, batch)
    # allocating anew (fresh pages on CPU): sharded buffers, and DDP's gradients where they are fresh
    out["fresh_memory"] = fresh_memory(spec["sizes"], spec["iters"], device)
    compute_s = statistics.median(_compute(model, workload, batch) for _ in range(2))
    # One size for all ranks (rank 0's choice): the all-reduce that lasts about as long as the
    # compute, so that the two overlap for most of their lives.
    sizes = [_matched_size(spec["sizes"], out["collectives"][a], compute_s) for a in spec["algorithms"]]
    dist.broadcast_object_list(sizes, src=0)
    out["contention"] = {a: _contention(a, n, model, workload, batch, spec["reps"])
                         for a, n in zip(spec["algorithms"], sizes)}
    # the write-back's copies against each algorithm's all-reduce, at the table size nearest 16 MiB
    if device.type == "cpu":  # (on a GPU the write-back is a device copy: not measured here)
        copy_size = min(spec["sizes"], key=lambda n: abs(n - (16 << 20)))
        out["copy_contention"] = {a: copy_contention(copy_size, spec["reps"], a) for a in spec["algorithms"]}
    if dist.get_backend() == "gloo" and "native" in spec["algorithms"] and world > 1:
        out["queue"] = {"native": queued(spec["sizes"], total, max(spec["reps"], 3))}
    out["allocator"] = allocator_state(device)
    out["device_name"] = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return out


def _fresh_model(spec: dict[str, Any]) -> torch.nn.Module:
    torch.manual_seed(0)
    return build_workload(spec["model"], **spec["model_kwargs"]).model.to(spec.get("device", "cpu"))


def _matched_size(sizes: list[int], seconds: list[float], target_s: float) -> int:
    """Bytes whose all-reduce lasts about ``target_s``: interpolated in the table, extrapolated
    along its last segment beyond it (at most 256 MiB). A collective much shorter than the
    compute would leave the compute's factor resting on a few milliseconds of overlap."""
    slope = (seconds[-1] - seconds[-2]) / (sizes[-1] - sizes[-2]) if len(sizes) > 1 else 0.0
    if target_s > seconds[-1] and slope > 0:
        return int(min(sizes[-1] + (target_s - seconds[-1]) / slope, 256 << 20)) // 4 * 4
    best = min(range(len(sizes)), key=lambda i: abs(seconds[i] - target_s))
    return max(int(sizes[best]), 1 << 16)


def _profile_ddp(spec: dict[str, Any], loss_fn, batch, group) -> dict[str, Any]:
    """Step 1: two one-rank DDP runs with overlap off, one bucket and many buckets."""
    total = sum(p.numel() * p.element_size() for p in _fresh_model(spec).parameters() if p.requires_grad)
    big = _ddp_run(spec, loss_fn, batch, group, bucket_mb=2 * total / 2**20 + 1)
    small_mb = max(total / 2**20 / 16, 0.01)  # about 16 buckets (fewer where parameters are large)
    small = _ddp_run(spec, loss_fn, batch, group, bucket_mb=small_mb)
    extra = small["buckets"] - big["buckets"]
    # Everything after the last gradient, less the write-backs (the same bytes in both runs):
    # launches, the one-rank all-reduces and the waits, per bucket.
    fixed = max((small["tail_s"] - small["write_back_s"] - big["tail_s"] + big["write_back_s"]) / extra, 0.0) \
        if extra > 0 else 0.0
    # The write-back is timed by DDP itself (IterationTiming.write_back); it is not in
    # exposed_comm, which ends when the last all-reduce is done (commlab/ddp/timing.py), so
    # solving for it from the exposed time found ~0 where it is 8-25 ms for 48 MiB here.
    writeback = big["write_back_s"] / total
    return {**big, "bucket_fixed_s": fixed, "writeback_s_per_byte": writeback, "total_bytes": total,
            "small_run": {k: small[k] for k in ("buckets", "exposed_s", "tail_s", "write_back_s")}}


def _ddp_run(spec: dict[str, Any], loss_fn, batch, group, bucket_mb: float) -> dict[str, Any]:
    # Calibration must never run the configurations it will predict: a DDP
    # iteration here is always on a one-rank group.
    if dist.get_world_size(group) != 1:
        raise RuntimeError("calibration profiles DDP on a one-rank process group only")
    model = _fresh_model(spec)
    clock = clock_for(torch.device(spec.get("device", "cpu")))
    ddp = commlab.DistributedDataParallel(model, process_group=group, bucket_cap_mb=bucket_mb, overlap=False)
    params = [p for p in model.parameters() if p.requires_grad]
    stamps: dict[int, Any] = {}
    # Registered after DDP's hooks, so they run after the gradient was copied into its bucket.
    handles = [p.register_post_accumulate_grad_hook(lambda _p, i=i: stamps.__setitem__(i, clock.stamp()))
               for i, p in enumerate(params)]
    optimizer = build_optimizer(_optimizer(spec), ddp.parameters())  # the one the runs step
    inputs, target = batch
    rows: list[dict[str, Any]] = []

    def step() -> None:
        # Every rank profiles at once, in the lockstep a multi-rank step keeps: a step starts, and the
        # optimizer steps, on every rank together (after the last all-reduce), so a memory-bound
        # phase meets the same phase of the other ranks, not whatever they happen to run.
        dist.barrier()
        stamps.clear()
        nosync = timed(clock, lambda: _nosync_step(ddp, loss_fn, inputs, target))
        stamps.clear()
        faults = _minor_faults()
        start = clock.stamp()  # the forward's start: the gradients' ready times count from it
        loss_fn(ddp(inputs), target).backward()
        # host pages: on a GPU the gradients are the caching allocator's, never fresh pages
        fresh = (_minor_faults() - faults) * resource.getpagesize() if spec.get("device", "cpu") == "cpu" else 0
        dist.barrier()
        opt = timed(clock, lambda: (optimizer.step(), optimizer.zero_grad(set_to_none=True)))
        timing = ddp.iteration_timings[-1]
        since = {i: clock.seconds(start, stamp) for i, stamp in stamps.items()}
        order = sorted(since, key=since.get)
        rows.append({"forward": timing.forward, "ready": {i: since[i] - timing.forward for i in order},
                     "order": order, "exposed": timing.exposed_comm, "nosync": nosync, "optimizer": opt,
                     "tail": timing.total - timing.forward - timing.backward_compute, "write_back": timing.write_back,
                     "fresh_bytes": fresh})

    timed_steps(step, spec["reps"], spec["warmup"], warmed=rows.clear)  # its own times are in the rows
    for h in handles:
        h.remove()
    order = rows[0]["order"]
    med = lambda xs: float(statistics.median(xs))  # noqa: E731
    return {
        "forward_s": med([r["forward"] for r in rows]),
        "ready_order": order,
        # cumulative time from the end of forward at which each parameter (in ready order) is ready
        "ready_s": [med([r["ready"][i] for r in rows]) for i in order],
        "exposed_s": med([r["exposed"] for r in rows]),
        "tail_s": med([r["tail"] for r in rows]),
        "write_back_s": med([r["write_back"] for r in rows]),
        "nosync_s": med([r["nosync"] for r in rows]),
        "optimizer_s": med([r["optimizer"] for r in rows]),
        "buckets": len(ddp.bucket_sizes),
        # pages first touched in forward+backward (the gradients over the mmap threshold: commlab/_malloc.py)
        "fresh_bytes": med([r["fresh_bytes"] for r in rows]),
        # forward + backward of every repetition: their spread says how steady the machine was
        "step_samples": [r["forward"] + max(r["ready"].values()) for r in rows],
    }


def _optimizer(spec: dict[str, Any]) -> str:
    return spec.get("optimizer", DEFAULT_OPTIMIZER)  # a spec made before the optimizer was keyed: SGD


def _minor_faults() -> int:
    """This process's minor page faults so far (a page first touched: fresh memory)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _nosync_step(ddp, loss_fn, inputs, target) -> None:
    with ddp.no_sync():
        loss_fn(ddp(inputs), target).backward()


def _time_collective(algorithm: str, sizes: list[int], iters: int,
                     device: torch.device = torch.device("cpu")) -> tuple[list[float], list[list[float]]]:
    """Median seconds of one all-reduce per size (each after a barrier), on this rank, and the
    samples they are the median of (their spread says how steady the machine was)."""

    def prepare(nbytes: int):
        buf = torch.ones(max(nbytes // 4, 1), dtype=torch.float32, device=device)
        return lambda: collectives.all_reduce(buf, "sum", algorithm=algorithm)

    clock = clock_for(device)
    every = time_sizes(prepare, sizes, iters, clock=clock, each=collective_timer(device, clock))
    return [float(statistics.median(samples)) for samples in every], every


def _device_of(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


def _forward_backward(model, workload, batch):
    """The model's forward + backward on ``batch`` (gradients freed after): the compute measured."""
    def step():
        workload.loss_fn(model(batch[0]), batch[1]).backward()
        model.zero_grad(set_to_none=True)

    return step


def _compute(model, workload, batch) -> float:
    return timed(clock_for(_device_of(model)), _forward_backward(model, workload, batch))


def _contention(algorithm: str, nbytes: int, model, workload, batch, reps: int) -> dict[str, float]:
    """Step 3: forward+backward and an all-reduce of a matched length, alone and together."""
    device = _device_of(model)
    buf = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    side = torch.cuda.Stream(device) if device.type == "cuda" else None
    measured = alone_and_together(algorithm, buf, _forward_backward(model, workload, batch), reps, clock_for(device), side)
    return {**measured, "nbytes": nbytes}
