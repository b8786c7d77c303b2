"""One configuration measured on one rank: build the workload, wrap it (DDP or sharded), time every step.

:func:`measure` runs inside an initialised process group (spawned by :func:`commlab.launch`, or
one torchrun rank). Run as a module it is the torchrun launcher's entry point::

    torchrun --nproc-per-node 2 -m commlab.sweep.worker CONFIG.json RESULT.json TIMEOUT

which measures the configuration on every rank and has each node's local rank 0 write all
ranks' results.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import traceback
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

import commlab
from commlab._malloc import keep_freed_memory
from commlab.models import build_workload
from commlab.runtime.metadata import thread_settings
from commlab.runtime.threads import use_rank_threads
from commlab.runtime.timer import WallClock, timed_steps
from commlab.memtrack import live_bytes, track_peak
from commlab.sweep import layout, pipelined, wrap as sharding
from commlab.runs.config import Config, optimizer_of
from commlab.runs.optimizers import build_optimizer
from commlab.tensor import gpt_plan, parallelize, record_timings, timings as tensor_timings


def _unlabelled(name: str):
    return nullcontext()


@dataclass
class Trainer:
    """One rank's training state for a configuration (``ddp``: DDP at stage 0, else
    ShardedDataParallel), and how to time one optimizer step."""

    cfg: Config
    rt: Any
    workload: Any
    ddp: Any
    optimizer: Any
    inputs: Any
    target: Any
    tensor_parallel: Any = None  # the module commlab.tensor.parallelize returned (tp > 1), for its timings

    def now(self) -> float:
        return WallClock(self.rt.device).stamp()

    def step(self, label=_unlabelled) -> dict[str, float]:
        """One optimizer step; ``label`` (torch.profiler.record_function when profiling) names its
        phases; returns their seconds, the whole step's included."""
        loss_fn, ddp, x, y = self.workload.loss_fn, self.ddp, self.inputs, self.target
        start = self.now()
        for _ in range(self.cfg.accumulate - 1):
            with label("commlab:no_sync micro-batch"), ddp.no_sync():
                loss_fn(ddp(x), y).backward()
        synced = self.now()
        with label("commlab:forward"):
            loss = loss_fn(ddp(x), y)
        with label("commlab:backward + gradient all-reduce"):
            loss.backward()
        backward_end = self.now()
        with label("commlab:optimizer"):
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        end = self.now()
        return {"accumulate_time": synced - start, "optimizer": end - backward_end, "step": end - start}


def prepare(cfg: Config) -> Trainer | pipelined.PipelineTrainer:
    """Build the workload, its wrapper and the configuration's optimizer (commlab/runs/optimizers.py)
    for ``cfg`` on this rank. With plain SGD (no state) stages 1-2 save only gradients; Adam's
    two moments are what stage 1 shards."""
    rt = commlab.Runtime.current()
    # Before the workload allocates anything: glibc's heap thresholds fixed, as the calibration
    # that predicts this configuration runs them (commlab/_malloc.py).
    keep_freed_memory()
    # The configuration's thread count, whatever the launcher chose (commlab.launch gives
    # cpu_count // world_size, torchrun OMP_NUM_THREADS=1): equal compute per rank at every
    # world size is what makes a scaling efficiency mean something.
    use_rank_threads(cfg.world_size, fixed=cfg.threads)
    torch.manual_seed(0)  # identical initial weights on every rank, as DDP (and the layers' slicing) expects
    workload = build_workload(cfg.model, **cfg.model_kwargs())
    if cfg.pp > 1:
        return pipelined.prepare(cfg, rt, workload)
    model = workload.model.to(rt.device)
    tp_group, dp_group, dp_index, replicate_group = layout.build_groups(cfg)
    split = None
    if cfg.tp > 1:
        split = parallelize(model, gpt_plan(), group=tp_group, algorithm=cfg.algorithm)
        record_timings(split)
    ddp = sharding.wrap(cfg, model, dp_group, replicate_group)
    optimizer = build_optimizer(optimizer_of(cfg), ddp.parameters())
    # One batch per data-parallel replica: the ranks of a tensor-parallel group share it.
    gen = torch.Generator().manual_seed(1000 + dp_index)
    inputs, target = (t.to(rt.device) for t in workload.make_batch(cfg.batch_per_rank, gen))
    return Trainer(cfg, rt, workload, ddp, optimizer, inputs, target, split)


def measure(cfg: Config) -> dict[str, Any]:
    """Time ``cfg.warmup + cfg.iters`` optimizer steps on this rank; return its rows.

    A step is ``cfg.accumulate`` micro-batches, all but the last under ``no_sync`` (gradient
    accumulation without communication, the paper's section 3.2), then the optimizer. DDP
    records the synchronised micro-batch's breakdown (forward, backward compute, comm, exposed
    comm, per-bucket times); the optimizer, the no_sync micro-batches and the whole step are
    timed here. The batch is generated once: data loading is not what a sweep measures. With
    pipeline stages (pp > 1) a micro-batch is a pipeline step: commlab/sweep/pipelined.py.
    """
    trainer = prepare(cfg)
    rt = trainer.rt
    iterations, buckets, measures = (pipelined.measure_steps(trainer) if cfg.pp > 1 else _data_parallel_steps(trainer))
    measures = {"peak_bytes": peak_step_bytes(trainer), **measures}
    device = torch.cuda.get_device_name(rt.device) if rt.device.type == "cuda" else "cpu"
    return {"rank": rt.rank, "host": socket.gethostname(), "device": device, "threads": thread_settings(),
            "iterations": iterations, "buckets": buckets, "measures": measures}


def _data_parallel_steps(trainer: Trainer) -> tuple[list, list, dict[str, float]]:
    """One stage: the timed steps' iteration and bucket rows, and the wrapper's measures."""
    cfg, rt, ddp = trainer.cfg, trainer.rt, trainer.ddp
    steps: list[dict[str, float]] = []
    before = 0

    def forget_warmup() -> None:
        nonlocal before
        if cfg.zero_stage.ddp:
            ddp.reset_timings()
        before = len(ddp.iteration_timings)
        steps.clear()

    # The step times itself, phase by phase (Trainer.step); the loop's own seconds are not used.
    timed_steps(lambda: steps.append(trainer.step()), cfg.iters, cfg.warmup, warmed=forget_warmup)
    timings = list(ddp.iteration_timings)[before:]
    if len(timings) != len(steps):
        raise RuntimeError(f"the wrapper recorded {len(timings)} synchronised iterations for {len(steps)} steps")
    axes = [dict.fromkeys(layout.AXIS_COLUMNS, 0.0) for _ in steps] if trainer.tensor_parallel is None else \
        layout.axis_seconds(tensor_timings(trainer.tensor_parallel), cfg.accumulate, len(steps))
    iterations, buckets = [], []
    sizes = [] if cfg.zero_stage.ddp else [len(b.params) for b in ddp.buckets]
    for i, (timing, own, axis) in enumerate(zip(timings, steps, axes)):
        row = timing.as_row() if cfg.zero_stage.ddp else sharding.iteration_row(timing)
        iterations.append({"rank": rt.rank, "iteration": i, **row, **own, **axis, "dp_reduce": row["comm"]})
        rows = ([{"bucket": b.index, "nbytes": b.nbytes, "num_params": b.num_params, "ready": b.ready,
                  "launched": b.launched, "done": b.done} for b in timing.buckets]
                if cfg.zero_stage.ddp else sharding.bucket_rows(timing, sizes))
        buckets += [{"rank": rt.rank, "iteration": i, **r} for r in rows]
    return iterations, buckets, sharding.step_measures(ddp, cfg, timings)


def peak_step_bytes(trainer: Trainer) -> int:
    """Peak bytes of one step on this rank: live bytes at its start plus its allocations' peak.

    Measured on two extra, untimed steps after the timed ones: on CPU tracking runs the profiler
    (commlab/memtrack.py), which the timed steps must not pay for, and the first tracked step
    only makes the blocks it allocates known, so that the second's frees of them are seen.
    The step is deterministic, so its peak is that of every measured step. Stages 1-3 measure
    through ShardedMemory's own tracking (which waits for the all-gathers stages 1-2 issue after
    the optimizer before a window closes); DDP has nothing in flight after its step."""
    device, wrapper = trainer.rt.device, trainer.ddp
    if not trainer.cfg.zero_stage.ddp:
        from commlab.sharded.memory import track_memory

        with track_memory(wrapper):
            trainer.step()
            trainer.step()
        return wrapper.memory(trainer.optimizer).peak
    with track_peak(device):
        trainer.step()
    entry = live_bytes(device)
    with track_peak(device) as peak:
        trainer.step()
    return entry + peak.peak_bytes


def main(argv: list[str]) -> int:
    """torchrun entry point: measure on every rank; global rank 0 writes the gathered results."""
    from commlab._atomic import write_text

    config_path, result_path, timeout = argv[0], argv[1], float(argv[2])
    with open(config_path) as f:
        cfg = Config.from_columns(json.load(f))
    try:
        results = commlab.launch(measure, cfg, world_size=cfg.world_size, backend=cfg.backend, timeout=timeout)
        # Every node's local rank 0 writes (all ranks hold the gathered results), so that the
        # sweep driver on each node of a multi-node job sees the configuration finish.
        if commlab.Runtime.current().local_rank == 0:
            write_text(result_path, json.dumps(results))
    except BaseException:
        # torchrun's own report names the rank but not the error: leave the traceback for the driver.
        rank = os.environ.get("RANK", "?")
        write_text(f"{result_path}.rank{rank}.error", traceback.format_exc())
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
