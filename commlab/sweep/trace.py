"""One configuration's measured steps as Chrome trace JSON (open in Perfetto or chrome://tracing).

This is the light, reconstructed trace (no new run, and no shared clock across ranks); the real
one, recorded with torch.profiler, is :mod:`commlab.sweep.torch_trace` (``commlab trace --torch-profiler``).

Each rank is a process; its compute phases are one thread and each bucket's all-reduce another
(buckets may be in flight at the same time, and a trace thread must nest its spans). Steps are
laid end to end on each rank using the measured step times, as they ran back to back.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pandas as pd

from commlab._atomic import write_text
from commlab.sweep import figdata
from commlab.sweep.figdata import first_repetition

_US = 1e6  # trace timestamps are microseconds


def chrome_trace(iterations: pd.DataFrame, buckets: pd.DataFrame, config: str) -> dict[str, Any]:
    """The trace of every measured step of ``config`` on every rank (pure)."""
    # One repetition of --repeat: they ran minutes apart, not back to back.
    its = first_repetition(iterations[iterations["config"] == config]).sort_values(["rank", "iteration"])
    if its.empty:
        raise ValueError(f"no measured iterations for configuration {config!r}")
    bks = first_repetition(buckets[buckets["config"] == config])
    events: list[dict[str, Any]] = []
    for rank, rank_its in its.groupby("rank"):
        rank = int(rank)
        events.append(_meta("process_name", rank, 0, f"rank {rank}"))
        events.append(_meta("thread_name", rank, 0, "compute"))
        named: set[int] = set()
        offset = 0.0
        for _, it in rank_its.iterrows():
            i = int(it["iteration"])
            t0 = offset + it["accumulate_time"]  # DDP's times count from the synchronised forward
            args = {"iteration": i}
            if it["accumulate"] > 1:
                events.append(_span("no_sync micro-batches", rank, 0, offset, it["accumulate_time"], args))
            events.append(_span("forward", rank, 0, t0, it["forward"], args))
            events.append(_span("backward compute", rank, 0, t0 + it["forward"], it["backward_compute"], args))
            if it["exposed_comm"] > 0:
                # commlab/ddp/timing.py: from the end of backward compute to the last bucket's
                # completion (the write-back and the end of backward follow it, up to ``total``).
                backward_end = t0 + it["forward"] + it["backward_compute"]
                events.append(_span("exposed comm", rank, 0, backward_end, it["exposed_comm"], args))
            events.append(_span("optimizer", rank, 0, t0 + it["total"], it["optimizer"], args))
            mine = bks[(bks["rank"] == rank) & (bks["iteration"] == i)]
            for _, b in mine.iterrows():
                tid = 1 + int(b["bucket"])
                if tid not in named:
                    named.add(tid)
                    events.append(_meta("thread_name", rank, tid, f"bucket {int(b['bucket'])}"))
                bargs = {**args, "nbytes": int(b["nbytes"]), "num_params": int(b["num_params"])}
                events.append({"name": "ready", "ph": "i", "s": "t", "pid": rank, "tid": tid,
                               "ts": (t0 + b["ready"]) * _US, "args": bargs})
                if b["launched"] > b["ready"]:
                    events.append(_span("waiting to launch", rank, tid, t0 + b["ready"], b["launched"] - b["ready"], bargs))
                events.append(_span("all-reduce", rank, tid, t0 + b["launched"], b["done"] - b["launched"], bargs))
            offset += it["step"]
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"config": config, "kind": "reconstructed from measured times, steps laid end to end"}}


def pick_config(runs: pd.DataFrame, config: str | None, run_dir: Path, buckets: pd.DataFrame | None = None) -> str:
    """``config`` checked against the results, or by default a successful configuration that
    communicates (world size above 1: one rank alone has nothing to all-reduce), the one the
    timeline figure draws among them (overlapped, the most buckets), else the first successful."""
    if config is None:
        ok = runs[runs["status"] == "ok"]
        if ok.empty:
            raise ValueError(f"{run_dir} has no successful configuration to trace")
        talking = ok[ok["world_size"] > 1]
        if talking.empty:
            return str(ok["config"].iloc[0])
        return figdata.pick_timeline_config(talking, buckets if buckets is not None else pd.DataFrame()) \
            or str(talking["config"].iloc[0])
    if config not in set(runs["config"]):
        raise ValueError(f"no configuration {config!r} in {run_dir}; choose from: {', '.join(runs['config'])}")
    return config


def write_trace(iterations: pd.DataFrame, buckets: pd.DataFrame, runs: pd.DataFrame, config: str | None,
                output: Path | None, run_dir: Path) -> Path:
    """Write the reconstructed trace of ``config`` (default: :func:`pick_config`'s); return its path."""
    config = pick_config(runs, config, run_dir, buckets)
    path = Path(output) if output else Path(run_dir) / f"trace-{config}.json"
    write_text(path, json.dumps(chrome_trace(iterations, buckets, config)))
    return path


def _span(name: str, pid: int, tid: int, start: float, dur: float, args: dict) -> dict[str, Any]:
    return {"name": name, "ph": "X", "pid": pid, "tid": tid, "ts": start * _US, "dur": max(0.0, dur) * _US, "args": args}


def _meta(kind: str, pid: int, tid: int, name: str) -> dict[str, Any]:
    return {"name": kind, "ph": "M", "pid": pid, "tid": tid, "args": {"name": name}}
