"""Summary statistics of a sweep: the median step and its quartiles, samples per second, scaling efficiency.

Pure pandas functions over the tidy tables (see :mod:`commlab.runs.store`).
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from commlab.runs.config import CONFIG_COLUMNS

# The parts of one optimizer step, in time order: no_sync micro-batches, then the synchronised
# micro-batch (DDP's forward, backward compute, exposed communication), then the optimizer.
SEGMENTS = ["accumulate_time", "forward", "backward_compute", "exposed_comm", "optimizer"]
# Seconds per step in each parallel axis's collectives (commlab/runs/store.py defines them); in
# results older than them they are missing, and their medians NaN.
AXIS_COLUMNS = ["tp_all_reduce", "tp_all_gather", "tp_reduce_scatter", "pp_send_recv", "pp_bubble", "dp_reduce"]
PHASES = ["forward", "backward_compute", "comm", "exposed_comm", "optimizer", "total", "accumulate_time", *AXIS_COLUMNS]
# What summarise() adds to a runs table.
_SUMMARY = {"iterations", "repetitions", "step_q1", "step_q3", "step_spread_lo", "step_spread_hi", "step_p10",
            "step_p90", "samples_per_s", "scaling_efficiency", *(f"{c}_median" for c in (*PHASES, "other", "step"))}
# Columns that change with the world size inside one scaling series.
_SCALING_AXIS = ["config", "world_size", "global_batch", "batch_per_rank"]


def slowest_ranks(iterations: pd.DataFrame) -> pd.DataFrame:
    """One row per (configuration, repetition, iteration): the slowest rank's, whose ``step`` is
    the step.

    Ranks finish a synchronised step at nearly the same time (the all-reduce is a barrier); the
    slowest rank is what the job waits for, so it defines the step, and its phases are the step's.
    """
    keys = ["config", *_rep(iterations), "iteration"]
    return iterations.loc[iterations.groupby(keys)["step"].idxmax()]


def median_step(rows: pd.DataFrame) -> pd.DataFrame:
    """Per configuration, the median step and its parts (the one statistic of the console and
    every figure): of the slowest-rank rows ordered by step, the middle one, or the mean of the
    two middle ones when their number is even. Its ``step`` is the median step, and its phases
    with ``other`` (the step minus its named segments: zero_grad, Python between them) add up to
    it exactly, which medians taken phase by phase would not."""
    columns = [*PHASES, "other", "step"]
    rows = rows.assign(**{c: rows[c] if c in rows else float("nan") for c in AXIS_COLUMNS})
    rows = rows.assign(other=rows["step"] - rows[SEGMENTS].sum(axis=1))

    def middle(group: pd.DataFrame) -> pd.Series:
        ordered = group.sort_values("step", kind="stable")
        n = len(ordered)
        return ordered.iloc[[(n - 1) // 2, n // 2]][columns].mean()

    if rows.empty:
        return pd.DataFrame(columns=columns, index=pd.Index([], name="config"), dtype=float)
    return rows.groupby("config")[columns].apply(middle)


def summarise(runs: pd.DataFrame, iterations: pd.DataFrame) -> pd.DataFrame:
    """Add per-configuration statistics to ``runs`` (one row per configuration).

    The step of an iteration is its slowest rank's (:func:`slowest_ranks`). ``step_median`` is
    the median step over every measured iteration of every repetition, ``step_q1``/``step_q3``
    their quartiles (the band of every figure), ``<phase>_median`` and ``other_median`` the
    phases of that median step (:func:`median_step`: they add up to ``step_median``);
    ``step_p10``/``step_p90`` are the same steps' 10th and 90th percentiles (the measured noise the
    cost model's comparison reads); ``step_spread_lo``/``step_spread_hi`` the smallest and largest
    of the repetitions' median steps (the drift between repetitions; equal with one);
    ``samples_per_s`` counts every micro-batch of a step (``global_batch * accumulate /
    step_median``); ``scaling_efficiency`` is given by :func:`scaling_efficiency`.
    """
    # Recomputed, not kept, when ``runs`` already holds them: results summarised by an older
    # commlab redraw with the statistic the console prints now.
    runs = runs.drop(columns=[c for c in runs if c in _SUMMARY])
    rows = slowest_ranks(iterations)
    # numbers even when no configuration finished (an empty CSV reads as text columns)
    rows = rows.astype({c: float for c in rows if c in ("step", *PHASES)})
    per_rep = rows.groupby(["config", *_rep(rows)])["step"].median().groupby("config")
    pooled = rows.groupby("config")["step"]
    stats = pd.DataFrame({
        "iterations": pooled.size(),
        "repetitions": per_rep.size(),
        "step_q1": pooled.quantile(0.25),
        "step_q3": pooled.quantile(0.75),
        "step_spread_lo": per_rep.min(),
        "step_spread_hi": per_rep.max(),
        "step_p10": pooled.quantile(0.1),
        "step_p90": pooled.quantile(0.9),
    })
    middle = median_step(rows)
    stats = stats.join(middle["step"].rename("step_median"))
    stats = stats.join(middle[[*PHASES, "other"]].add_suffix("_median"))
    runs = runs.join(stats, on="config")
    for count in ("iterations", "repetitions"):
        runs[count] = runs[count].fillna(0).astype(int)
    runs["samples_per_s"] = runs["global_batch"] * runs["accumulate"] / runs["step_median"]
    runs["scaling_efficiency"] = scaling_efficiency(runs)
    return runs


def spread(row: pd.Series) -> tuple[float, float]:
    """The interval a configuration's median step is known to within: the repetitions' median
    steps when there are several, else the q1-q3 of its steps (one run says nothing about drift)."""
    if row.get("repetitions", 1) > 1:
        return float(row["step_spread_lo"]), float(row["step_spread_hi"])
    return float(row["step_q1"]), float(row["step_q3"])


# Configurations whose steps do the same work (so their step times compare): the same model,
# data and ranks; the rest (bucket size, overlap, algorithm, groups, threads) is what a sweep compares.
SAME_WORK = ["model", "model_args", "backend", "world_size", "global_batch", "batch_per_rank", "accumulate"]


def fastest(runs: pd.DataFrame) -> list[str]:
    """Per group of configurations doing the same work, a line naming the fastest, or saying
    that none clearly is.

    The fastest by median is called the winner only when its spread (:func:`spread`) lies wholly
    below the runner-up's: a difference smaller than the spread is within the noise.
    """
    ok = runs[(runs["status"] == "ok") & runs["step_median"].notna()]
    lines = []
    for _, group in ok.groupby([c for c in SAME_WORK if c in ok], dropna=False, sort=False):
        if len(group) < 2:
            continue
        best, second = group.sort_values("step_median").iloc[:2].itertuples(index=False)
        best, second = pd.Series(best._asdict()), pd.Series(second._asdict())
        (lo1, hi1), (lo2, hi2) = spread(best), spread(second)
        what = "min-max of the repetitions' medians" if best.get("repetitions", 1) > 1 else "q1-q3 of the steps"
        head = (f"{best['config']} median step {best['step_median'] * 1e3:.1f} ms [{lo1 * 1e3:.1f}, {hi1 * 1e3:.1f}] vs "
                f"{second['config']} {second['step_median'] * 1e3:.1f} ms [{lo2 * 1e3:.1f}, {hi2 * 1e3:.1f}] ({what})")
        lines.append(f"fastest: {head}" if hi1 < lo2 else
                     f"no clear winner: the fastest two differ by less than their spread: {head}")
    return lines


def _rep(df: pd.DataFrame) -> list[str]:
    return ["repetition"] if "repetition" in df else []


def scaling_efficiency(runs: pd.DataFrame) -> pd.Series:
    """Throughput relative to linear scaling from the smallest world size of the same series.

    A series is every configuration that differs only in world size (and the batch columns that
    follow from it). efficiency(w) = (samples/s at w / samples/s at w0) / (w / w0), so 1.0 is
    ideal for both strong and weak scaling; NaN where the series has no successful baseline.
    The baseline w0 is the smallest world size *in this grid*, not one process: a grid of world
    size 2 alone gives 1.0, whatever world size 2 costs against one process.
    """
    if runs.empty:
        return pd.Series(dtype=float, index=runs.index)
    keys = _series_keys(runs)
    out = pd.Series(np.nan, index=runs.index, dtype=float)
    ok = runs[(runs["status"] == "ok") & runs["samples_per_s"].notna()]
    for _, series in ok.groupby(keys, dropna=False, sort=False):
        base = series.loc[series["world_size"].idxmin()]
        ratio = series["samples_per_s"] / base["samples_per_s"]
        out.loc[series.index] = ratio / (series["world_size"] / base["world_size"])
    return out


def _series_keys(runs: pd.DataFrame) -> list[str]:
    return [c for c in CONFIG_COLUMNS if c not in _SCALING_AXIS and c in runs]


def superlinear(runs: pd.DataFrame) -> list[str]:
    """A warning per configuration whose scaling efficiency is above 1.

    Above-linear scaling on one machine usually means the ranks did not get equal resources (more
    threads per rank at small world sizes, a cache effect, or load that changed during the sweep),
    not that communication is free: the number needs checking before it is reported.
    """
    if "scaling_efficiency" not in runs:
        return []
    high = runs[runs["scaling_efficiency"] > 1.0]
    return [
        f"warning: {r['config']}: scaling efficiency {r['scaling_efficiency']:.2f} > 1 (world size "
        f"{r['world_size']}, {r['threads']} thread(s) per rank): above linear, check machine load and threads"
        for _, r in high.iterrows()
    ]
