"""Summary statistics of a sweep: medians, p10/p90, samples per second, scaling efficiency.

Pure pandas functions over the tidy tables (see :mod:`commlab.runs.store`).
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from commlab.runs.config import CONFIG_COLUMNS

# The parts of one optimizer step, in time order: no_sync micro-batches, then the synchronised
# micro-batch (DDP's forward, backward compute, exposed communication), then the optimizer.
SEGMENTS = ["accumulate_time", "forward", "backward_compute", "exposed_comm", "optimizer"]
PHASES = ["forward", "backward_compute", "comm", "exposed_comm", "optimizer", "total", "accumulate_time"]
# Columns that change with the world size inside one scaling series.
_SCALING_AXIS = ["config", "world_size", "global_batch", "batch_per_rank"]


def step_per_iteration(iterations: pd.DataFrame) -> pd.DataFrame:
    """One row per (configuration, repetition, iteration): the step time of the slowest rank.

    Ranks finish a synchronised step at nearly the same time (the all-reduce is a barrier); the
    slowest rank is what the job waits for, so it defines the step.
    """
    return iterations.groupby(["config", *_rep(iterations), "iteration"], as_index=False)["step"].max()


def summarise(runs: pd.DataFrame, iterations: pd.DataFrame) -> pd.DataFrame:
    """Add per-configuration statistics to ``runs`` (one row per configuration).

    ``step_median`` is the median over repetitions of each repetition's median slowest-rank step
    (with one repetition, simply the median); ``step_spread_lo``/``step_spread_hi`` are the
    smallest and largest repetition medians (the drift between repetitions, equal to the median
    with one); ``step_p10``/``step_p90`` are over every measured iteration of every repetition;
    ``<phase>_median`` over every rank and iteration; ``samples_per_s`` counts every micro-batch of
    a step (``global_batch * accumulate / step_median``); ``scaling_efficiency`` is given by
    :func:`scaling_efficiency`.
    """
    runs = runs.copy()
    steps = step_per_iteration(iterations)
    per_rep = steps.groupby(["config", *_rep(steps)])["step"].median().groupby("config")
    pooled = steps.groupby("config")["step"]
    stats = pd.DataFrame({
        "iterations": pooled.size(),
        "repetitions": per_rep.size(),
        "step_median": per_rep.median(),
        "step_spread_lo": per_rep.min(),
        "step_spread_hi": per_rep.max(),
        "step_p10": pooled.quantile(0.1),
        "step_p90": pooled.quantile(0.9),
    })
    medians = iterations.groupby("config")[PHASES].median().add_suffix("_median")
    stats = stats.join(medians)
    runs = runs.join(stats, on="config")
    for count in ("iterations", "repetitions"):
        runs[count] = runs[count].fillna(0).astype(int)
    runs["samples_per_s"] = runs["global_batch"] * runs["accumulate"] / runs["step_median"]
    runs["scaling_efficiency"] = scaling_efficiency(runs)
    return runs


def spread(row: pd.Series) -> tuple[float, float]:
    """The interval a configuration's step time is known to within: across repetitions when
    there are several, else the p10-p90 of its iterations (one run says nothing about drift)."""
    if row.get("repetitions", 1) > 1:
        return float(row["step_spread_lo"]), float(row["step_spread_hi"])
    return float(row["step_p10"]), float(row["step_p90"])


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
        what = "across repetitions" if best.get("repetitions", 1) > 1 else "p10-p90 of iterations"
        head = (f"{best['config']} {best['step_median'] * 1e3:.1f} ms [{lo1 * 1e3:.1f}, {hi1 * 1e3:.1f}] vs "
                f"{second['config']} {second['step_median'] * 1e3:.1f} ms [{lo2 * 1e3:.1f}, {hi2 * 1e3:.1f}] ({what})")
        lines.append(f"fastest: {head}" if hi1 < lo2 else
                     f"no clear winner: the fastest two differ by less than their spread: {head}")
    return lines


def _rep(df: pd.DataFrame) -> list[str]:
    return ["repetition"] if "repetition" in df else []


def step_parts(iterations: pd.DataFrame) -> pd.DataFrame:
    """Per configuration, the mean of each step segment over the same iterations, and ``other``.

    For every iteration the slowest rank's row is taken (it defines the step, see
    :func:`step_per_iteration`); segments and step are averaged over those rows, and ``other`` is
    the step minus the named segments (time between them: the optimizer's zero_grad, Python).
    Means of the same rows add up, so the parts sum exactly to ``step`` (the mean step time),
    unlike per-segment medians, which come from different iterations and need not add up.
    """
    columns = [*SEGMENTS, "other", "step"]
    if iterations.empty:
        return pd.DataFrame(columns=[*columns, "step_lo", "step_hi"], index=pd.Index([], name="config"), dtype=float)
    keys = ["config", *_rep(iterations)]
    slowest = iterations.loc[iterations.groupby([*keys, "iteration"])["step"].idxmax()].copy()
    slowest["other"] = slowest["step"] - slowest[SEGMENTS].sum(axis=1)
    parts = slowest.groupby("config")[columns].mean()
    # The spread of the mean step across repetitions (error bars; one repetition: no bar).
    per_rep = slowest.groupby(keys)["step"].mean().groupby("config")
    return parts.assign(step_lo=per_rep.min(), step_hi=per_rep.max())


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
