"""A real trace: a few steps of one configuration under torch.profiler on every rank, merged.

``commlab trace RUN_DIR --torch-profiler`` reruns the configuration and records what really ran: the
phases commlab labels (forward, backward with its gradient all-reduces, optimizer, no_sync
micro-batches) as ``torch.profiler.record_function`` ranges, every torch operator, and the
backend's own collective events (c10d's ``gloo:all_reduce`` / ``nccl:all_reduce``, CUDA kernels
on GPUs). The default ``commlab trace`` is the light, reconstructed one: the measured phase and
bucket times of every step laid end to end, with no new run.

Clock: each rank's profiler has its own time base, so right after a barrier every rank marks
``commlab:clock sync``; merging shifts each rank so those marks coincide (ranks leave a barrier
within microseconds of each other on one host, and on several hosts this still aligns them to
the barrier's skew).
"""

from __future__ import annotations

import json
import os
import tempfile
from typing import Any

SYNC = "commlab:clock sync"


def trace_rank(cfg, steps: int) -> dict[str, Any]:
    """Run ``cfg.warmup`` steps, then ``steps`` under torch.profiler; return this rank's trace."""
    import torch
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile, record_function

    from commlab.sweep.worker import prepare

    trainer = prepare(cfg)
    for _ in range(cfg.warmup):
        trainer.step()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if trainer.rt.device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        dist.barrier()
        with record_function(SYNC):
            pass
        for i in range(steps):
            with record_function(f"commlab:step {i}"):
                trainer.step(label=record_function)
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        with open(path) as f:
            return json.load(f)
    finally:
        os.unlink(path)


def merge(per_rank: list[dict[str, Any]], config: str) -> dict[str, Any]:
    """One Chrome trace with a process per rank, every rank shifted onto rank 0's clock (pure)."""
    sync = [_sync_ts(trace, rank) for rank, trace in enumerate(per_rank)]
    events: list[dict[str, Any]] = []
    for rank, trace in enumerate(per_rank):
        shift = sync[rank] - sync[0]
        events.append({"name": "process_name", "ph": "M", "pid": rank, "args": {"name": f"rank {rank} (torch.profiler)"}})
        events.append({"name": "process_sort_index", "ph": "M", "pid": rank, "args": {"sort_index": rank}})
        for event in trace.get("traceEvents", []):
            if event.get("ph") == "M" and event.get("name") in ("process_name", "process_sort_index", "process_labels"):
                continue  # replaced by the rank's own
            event = {**event, "pid": rank}
            if "ts" in event:
                event["ts"] = float(event["ts"]) - shift
            events.append(event)
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"config": config, "kind": "torch.profiler, ranks aligned at a barrier"}}


def _sync_ts(trace: dict[str, Any], rank: int) -> float:
    for event in trace.get("traceEvents", []):
        if event.get("name") == SYNC and "ts" in event:
            return float(event["ts"])
    raise ValueError(f"rank {rank}'s trace has no {SYNC!r} event: not recorded by commlab.sweep.torch_trace")
