"""Time ratios of each all-reduce algorithm to a baseline (``native``), over repeated runs.

The ring is accepted by this figure: per message size, the in-place time of an algorithm
divided by the baseline's *from the same run* (the bench interleaves their iterations, so both
see the same background load), and per run the geometric mean of those ratios over the sizes.
One run on a shared machine can be 20% off either way, so ``--repeat`` runs the whole sweep
several times and this module prints, per size, the median and range of the ratio over the runs
and each run's own ratio and geomean: a bad run is seen instead of averaged away. Where the rows
carry each call's CPU time (``cpu_us``: user + system, all threads of a rank), it adds the
geomean of the CPU-time ratios, which other jobs' load moves far less than the wall time.
"""

from __future__ import annotations

import math
import statistics

import pandas as pd

from commlab.runs.traffic import format_size


def ratio_table(df: pd.DataFrame, baseline: str = "native", placement: str = "in-place") -> pd.DataFrame:
    """One row per (run, world size, algorithm other than ``baseline``, size): its time ratio.

    ``df`` holds the bench's tidy rows (``time_us`` per size x algorithm x placement x world
    size), with a ``run`` column when the sweep was repeated. Sizes the baseline lacks are left out.
    """
    df = df if "run" in df else df.assign(run=0)
    if "placement" in df:
        df = df[df["placement"] == placement]
    df = df if "cpu_us" in df else df.assign(cpu_us=math.nan)
    df = df if "collective" in df else df.assign(collective="all_reduce")
    keys = ["run", "collective", "world_size", "size_bytes"]
    base = df[df["algorithm"] == baseline][keys + ["time_us", "cpu_us"]]
    other = df[df["algorithm"] != baseline][keys + ["algorithm", "time_us", "cpu_us"]]
    out = other.merge(base, on=keys, suffixes=("", "_base"))
    out["ratio"] = out["time_us"] / out["time_us_base"]
    out["cpu_ratio"] = out["cpu_us"] / out["cpu_us_base"]
    return out[["run", "collective", "world_size", "algorithm", "size_bytes", "ratio", "cpu_ratio"]].reset_index(drop=True)


def geomeans(ratios: pd.DataFrame, column: str = "ratio") -> pd.DataFrame:
    """Per (run, collective, world size, algorithm): the geometric mean of ``column`` over the sizes."""
    ratios = ratios if "collective" in ratios else ratios.assign(collective="all_reduce")
    return (
        ratios.groupby(["run", "collective", "world_size", "algorithm"], sort=False)[column]
        .apply(statistics.geometric_mean)
        .rename("geomean")
        .reset_index()
    )


def ratio_lines(df: pd.DataFrame, baseline: str = "native", loads: dict | None = None) -> list[str]:
    """The printed summary: per (world size, algorithm) a block of per-size and geomean rows.

    ``loads`` maps (run, world size) to the 1-minute load average when that run started.
    """
    ratios = ratio_table(df, baseline)
    if ratios.empty:
        return []
    means = geomeans(ratios)
    lines = []
    for (collective, world, algorithm), part in ratios.groupby(["collective", "world_size", "algorithm"], sort=False):
        runs = sorted(part["run"].unique())
        name = "" if collective == "all_reduce" else f"{collective} "
        lines.append(f"# {name}{algorithm} / {baseline}, in-place time, world size {world}, {len(runs)} run(s): "
                     "median [min-max] over runs, then each run")  # fmt: skip
        for size, rows in part.groupby("size_bytes", sort=True):
            lines.append(_row(format_size(int(size)), rows.set_index("run")["ratio"], runs))
        mine = (means["collective"] == collective) & (means["world_size"] == world) & (means["algorithm"] == algorithm)
        g = means[mine].set_index("run")["geomean"]
        lines.append(_row("geomean", g, runs))
        if part["cpu_ratio"].notna().all():  # CPU time per call, all threads: the load-robust view
            c = geomeans(part, "cpu_ratio").set_index("run")["geomean"]
            lines.append(_row("cpu geo", c, runs))
        if loads:
            lines.append("#   " + "load".ljust(8) + " " * 25 + " ".join(f"{loads.get((r, world), math.nan):5.2f}" for r in runs))
    return lines


def _row(label: str, values: pd.Series, runs: list) -> str:
    each = " ".join(f"{values[r]:5.3f}" if r in values.index else "  n/a" for r in runs)
    return f"#   {label:<8} {values.median():6.3f} [{values.min():5.3f}-{values.max():5.3f}]    {each}"
