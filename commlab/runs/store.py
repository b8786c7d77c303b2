"""The results directory: one atomic record per configuration, tidy CSVs assembled from them.

Layout of ``results/<name>/``::

    configs/<config id>.json   one record per finished configuration (the source of truth);
                               <config id>.r<k>.json for repetition k > 0 of ``--repeat``
    iterations.csv             configuration columns + repetition, rank, iteration, phase seconds
    buckets.csv                configuration columns + repetition, rank, iteration, bucket timings
    runs.csv                   one row per configuration: status, error, summary statistics over
                               its repetitions
    metadata.json              versions, hardware, hosts, git commit, command line, times

Columns (besides the configuration's own, :data:`commlab.runs.config.CONFIG_COLUMNS`):

- iterations.csv, seconds of one micro-batch step on one rank (commlab.ddp.timing defines them):
  ``forward``, ``backward_compute``, ``comm`` (first bucket launched to last done),
  ``exposed_comm`` (communication after backward compute ended), ``total``, ``write_back``
  (copying the reduced buckets into ``.grad``), ``unused_allreduce`` (the all-reduce of the
  "used locally" flags of ``find_unused_parameters``; 0 without it), then ``accumulate_time``
  (the no_sync micro-batches), ``optimizer`` and ``step`` (the whole step); then each parallel
  axis's collectives, seconds per step (summed over its micro-batches; runs.csv has their
  ``<column>_median`` in the median step): ``tp_all_reduce``, ``tp_all_gather`` and
  ``tp_reduce_scatter`` (commlab.tensor's timings: on CPU all of it blocks the training thread),
  ``pp_send_recv`` (issuing and waiting on pipeline sends and receives, the bubble's waits
  included; 0 with one stage), ``pp_bubble`` (the schedule's idle time in them, replayed:
  commlab/sweep/pipelined.py), ``dp_reduce`` (the data-parallel reduction of the synchronised
  micro-batch, first launched to last done: ``comm``). With pipeline stages a micro-batch is a
  pipeline step of ``microbatches``; ``forward`` and ``backward_compute`` are the rank's compute in it.
- buckets.csv: ``bucket`` (its index), ``nbytes``, ``num_params`` and the seconds since
  forward start at which it was ``ready`` (its last gradient arrived), ``launched`` (its
  all-reduce issued; it may then wait behind the group's previous one) and ``done``.
- runs.csv: ``status``, ``error``, ``seconds``, ``threads_measured``, then the statistics of
  :func:`commlab.runs.stats.summarise`: ``step_median``, ``step_q1``/``step_q3``,
  ``step_p10``/``step_p90``, ``step_spread_lo``/``step_spread_hi``, ``<phase>_median`` and
  ``other_median`` (the median step's phases), ``samples_per_s`` and
  ``scaling_efficiency``. ``scaling_efficiency`` is relative to the *smallest world size of
  the same series in this grid*, not to one process: (samples/s at w / samples/s at w0) / (w /
  w0), so it is 1.0 on a grid whose only world size is 2, and it says nothing about w0 itself.
  Then, measured per configuration (commlab/sweep/wrap.py; empty in results older than them):
  ``peak_bytes`` (a step's peak bytes on a rank, the highest rank: live bytes at the step's start
  plus its allocations' peak, commlab/memtrack.py, measured on an untimed step after the timed
  ones), ``comm_bytes`` (bytes one rank sends per step: all-reduce 2(N-1)/N B, reduce-scatter
  and all-gather (N-1)/N B each, over the collectives the step ran; the highest rank),
  ``exposed_allgather`` and ``exposed_reducescatter`` (seconds per step the training thread
  waited on all-gathers, and on reductions after backward compute, stage 1's being all-reduces;
  medians over iterations, then over ranks; 0 at stage 0, whose exposed all-reduce is
  ``exposed_comm``).

A record is written to a temporary file in the same directory and then ``os.replace``-d into
place, so a sweep killed at any moment leaves either the whole record or none of it; the CSVs are
rebuilt from the records (also atomically), so they can never hold a half-written or duplicated
configuration.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pandas as pd

from commlab._atomic import write_text
from commlab.ddp.timing import COLUMNS
from commlab.runs.config import CONFIG_COLUMNS, LATER_FIELDS, Config
from commlab.runs.stats import AXIS_COLUMNS, summarise

RECORDS = "configs"
# One step's seconds: DDP's breakdown of the synchronised micro-batch (commlab.ddp.timing.COLUMNS,
# a torch-free module, so reading results and drawing figures import no torch), then what the
# sweep worker times around it. The predictor writes exactly these (commlab/costmodel/lowering/ddp.py).
TIMING_COLUMNS = list(COLUMNS)
STEP_COLUMNS = [*TIMING_COLUMNS, "accumulate_time", "optimizer", "step"]
ITERATION_COLUMNS = ["repetition", "rank", "iteration", *STEP_COLUMNS, *AXIS_COLUMNS]
# threads_measured: torch.get_num_threads() on the ranks (the most of any rank), next to the
# `threads` that the configuration asked for.
RUN_COLUMNS = ["status", "error", "seconds", "threads_measured"]
MEASURE_COLUMNS = ["peak_bytes", "comm_bytes", "exposed_allgather", "exposed_reducescatter"]
BUCKET_COLUMNS = ["repetition", "rank", "iteration", "bucket", "nbytes", "num_params", "ready", "launched", "done"]


def record(cfg: Config, started: float, results: list[dict[str, Any]] | None, *, measures: dict[str, float],
           error: str = "", status: str = "ok", repetition: int = 0, source: str | None = None) -> dict[str, Any]:
    """One configuration's record as saved under configs/: its ranks' iteration and bucket rows,
    hosts, devices and threads, and ``measures`` (:data:`MEASURE_COLUMNS`). ``source`` marks a
    record that was not measured (a prediction says ``predicted``)."""
    rec: dict[str, Any] = {"config": cfg.columns(), "repetition": repetition, "status": status, "error": error,
                           "started": started, "ended": time.time(), "iterations": [], "buckets": []}
    for rank_result in results or []:
        rec["iterations"] += rank_result["iterations"]
        rec["buckets"] += rank_result["buckets"]
    rec["hosts"] = sorted({r["host"] for r in results or []})
    rec["devices"] = sorted({r["device"] for r in results or []})
    # As measured on each rank (the configuration's `threads` is what was asked for).
    rec["threads"] = [r.get("threads") for r in results or []]
    rec["measures"] = {c: measures[c] for c in MEASURE_COLUMNS if c in measures}
    if source is not None:
        rec["source"] = source
    return rec


def save_record(run_dir: Path, record: dict[str, Any]) -> Path:
    rep = record.get("repetition", 0)
    path = Path(run_dir) / RECORDS / f"{record['config']['config']}{f'.r{rep}' if rep else ''}.json"
    write_text(path, json.dumps(record))
    return path


def load_records(run_dir: Path) -> list[dict[str, Any]]:
    """Every configuration record, in the order they were started."""
    records = []
    for path in sorted((Path(run_dir) / RECORDS).glob("*.json")):
        records.append(json.loads(path.read_text()))
    return sorted(records, key=lambda r: (r.get("started", 0), r["config"]["config"], r.get("repetition", 0)))


def finished_ids(run_dir: Path) -> set[tuple[str, int]]:
    """(configuration id, repetition) pairs that completed (``--resume`` skips them; failures are retried)."""
    return {(r["config"]["config"], r.get("repetition", 0)) for r in load_records(run_dir) if r["status"] == "ok"}


def tables(records: list[dict[str, Any]]) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame]:
    """The three tidy tables (iterations, buckets, runs) built from configuration records."""
    iter_rows, bucket_rows, per_config = [], [], {}
    for rec in records:
        # Records older than a configuration field hold its old value (and keep their ids).
        cfg, rep = {**LATER_FIELDS, **rec["config"]}, {"repetition": rec.get("repetition", 0)}
        iter_rows += [{**cfg, **rep, **row} for row in rec.get("iterations", [])]
        bucket_rows += [{**cfg, **rep, **row} for row in rec.get("buckets", [])]
        per_config.setdefault(cfg["config"], []).append(rec)
    run_rows = [_run_row(recs) for recs in per_config.values()]
    # Typed even when empty (every configuration failed), so that statistics still apply.
    iterations = pd.DataFrame(iter_rows, columns=CONFIG_COLUMNS + ITERATION_COLUMNS).astype(_dtypes(ITERATION_COLUMNS))
    buckets = pd.DataFrame(bucket_rows, columns=CONFIG_COLUMNS + BUCKET_COLUMNS).astype(_dtypes(BUCKET_COLUMNS))
    runs = summarise(pd.DataFrame(run_rows, columns=CONFIG_COLUMNS + RUN_COLUMNS + MEASURE_COLUMNS), iterations)
    return iterations, buckets, runs


def _run_row(records: list[dict[str, Any]]) -> dict[str, Any]:
    """One configuration's row from its repetitions: ok only when every repetition is."""
    bad = [r for r in records if r["status"] != "ok"]
    measured = [t["torch"] for r in records for t in r.get("threads") or [] if t]
    # Peak and bytes do not drift between repetitions; the exposed seconds are the median's.
    own = [r["measures"] for r in records if r.get("measures")]
    measures = {c: (pd.Series([m[c] for m in own]).median() if own else None) for c in MEASURE_COLUMNS}
    return {**LATER_FIELDS, **records[0]["config"], **measures, "status": bad[0]["status"] if bad else "ok",
            "error": bad[0].get("error", "") if bad else "",
            "seconds": sum(r.get("ended", 0) - r.get("started", 0) for r in records),
            "threads_measured": max(measured) if measured else None}


def _dtypes(columns: list[str]) -> dict[str, str]:
    counts = ("repetition", "rank", "iteration", "bucket", "nbytes", "num_params")
    return {c: ("int64" if c in counts else "float64") for c in columns}


def assemble(run_dir: Path, source: str | None = None) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame]:
    """Rebuild iterations.csv, buckets.csv and runs.csv from the records; return the tables.
    ``source`` (e.g. "predicted") becomes a second column of every table."""
    iterations, buckets, runs = tables(load_records(run_dir))
    for name, df in (("iterations", iterations), ("buckets", buckets), ("runs", runs)):
        if source is not None:
            df.insert(1, "source", source)
        # Nine significant digits: nanoseconds for timings up to a second, and half the bytes.
        write_text(Path(run_dir) / f"{name}.csv", df.to_csv(index=False, float_format="%.9g"))
    return iterations, buckets, runs


def read_tables(run_dir: Path) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame]:
    """Read the three CSVs of a results directory (as written by :func:`assemble`)."""
    run_dir = Path(run_dir)
    missing = [n for n in ("iterations", "buckets", "runs") if not (run_dir / f"{n}.csv").exists()]
    if missing:
        raise FileNotFoundError(f"{run_dir} has no {', '.join(m + '.csv' for m in missing)}: not a sweep results directory")
    frames = []
    for name in ("iterations", "buckets", "runs"):
        # Text columns stay text, empty as "" rather than NaN (groupby drops NaN keys).
        df = pd.read_csv(run_dir / f"{name}.csv", dtype={"model_args": str, "error": str})
        for text in ("model_args", "error"):
            if text in df:
                df[text] = df[text].fillna("")
        frames.append(df)
    return frames[0], frames[1], frames[2]


def read_metadata(run_dir: Path) -> dict[str, Any]:
    path = Path(run_dir) / "metadata.json"
    return json.loads(path.read_text()) if path.exists() else {}


def write_metadata(run_dir: Path, meta: dict[str, Any]) -> None:
    write_text(Path(run_dir) / "metadata.json", json.dumps(meta, indent=2, default=str) + "\n")
