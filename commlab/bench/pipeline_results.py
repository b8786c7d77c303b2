"""Pipeline benchmark results: rows from the ranks' measurements, the CSVs, and the console table.

:func:`summarise` makes one row per configuration (medians of the slowest rank's step, ratio to
torch, measured against simulated bubble, predicted step); :func:`stage_rows` and
:func:`timeline_rows` the per-stage and per-action rows; :func:`write` the three CSVs and the
metadata, each written atomically, so an interrupted run leaves the rows of every configuration
it finished.
"""

from __future__ import annotations

import json
import os
import statistics
from pathlib import Path
from typing import Any

from commlab._atomic import write_text
from commlab.costmodel.calibration.pipeline import (
    aligned,
    comm_latency,
    idle_breakdown,
    predicted_step,
    stage_times,
)
from commlab.pipeline.schedule.actions import Action
from commlab.pipeline.schedule.registry import build
from commlab.pipeline.schedule.simulate import bubble_formula, simulate


def rows(configs: list[dict[str, Any]], per_config: list[list[dict[str, Any]]], world: int, batch: int,
         backend: str) -> tuple[list, list, list]:  # fmt: skip
    """(summary, stages, timeline) rows of the configurations measured (``per_config[k]``: per rank)."""
    summary, stages, timeline = [], [], []
    for cfg, results in zip(configs, per_config):
        summary.append(summarise(cfg, results, world, batch, backend))
        stages += stage_rows(cfg, results)
        timeline += timeline_rows(cfg, results, world)
    return summary, stages, timeline


def write(run_dir: Path, summary: list, stages: list, timeline: list, meta: dict[str, Any]) -> None:
    """summary.csv, stages.csv, timeline.csv and metadata.json under ``run_dir``, atomically."""
    import pandas as pd  # loaded here: the CLI imports this module for its help text

    for file, table in (("summary.csv", summary), ("stages.csv", stages), ("timeline.csv", timeline)):
        write_text(Path(run_dir) / file, pd.DataFrame(table).to_csv(index=False))
    write_text(Path(run_dir) / "metadata.json", json.dumps(meta, indent=2, default=str))


def table(summary: list, stages: list) -> list[str]:
    """The console table: one line per configuration."""
    lines = [f"{'config':<30} {'commlab ms':>10} {'pred ms':>8} {'torch ms':>9} {'ratio':>6} {'paired':>6} {'samples/s':>9} "
             f"{'bubble':>6} {'wait':>6} {'ready':>6} {'sim':>6} {'replay':>6} {'formula':>7} {'msg ms':>6} {'stage0 MiB':>10}"]  # fmt: skip
    for row in summary:
        first = [s["saved_bytes"] for s in stages if s["config"] == row["config"] and s["stage"] == 0][0]
        torch_ms = f"{row['torch_s'] * 1e3:9.2f}" if "torch_s" in row else f"{'-':>9}"
        ratio = f"{row['ratio']:6.3f} {row['paired_ratio']:6.3f}" if "ratio" in row else f"{'-':>6} {'-':>6}"
        lines.append(f"{row['config']:<30} {row['commlab_s'] * 1e3:10.2f} {row['predicted_s'] * 1e3:8.2f} {torch_ms} {ratio} "
                     f"{row['commlab_samples_per_s']:9.1f} {row['bubble_measured']:6.3f} {row['idle_waiting']:6.3f} "
                     f"{row['idle_data_ready']:6.3f} {row['bubble_simulated']:6.3f} {row['bubble_replayed']:6.3f} "
                     f"{row['bubble_formula']:7.3f} {row['comm_latency_s'] * 1e3:6.2f} {first / 2**20:10.2f}")  # fmt: skip
    return lines


def summarise(cfg: dict[str, Any], per_rank: list[dict[str, Any]], world: int, batch: int, backend: str = "gloo") -> dict[str, Any]:
    """One row: medians of the slowest rank's step, ratio to torch, measured vs simulated bubble."""
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
