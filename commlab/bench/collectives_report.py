"""Results of `commlab bench collectives`: rows from ranks, the printed table, CSVs and figure."""

from __future__ import annotations

import math
import os

import pandas as pd

from commlab._atomic import write_via
from commlab.costmodel.terms.alpha_beta import bandwidths, fit_alpha_beta

KEY_COLUMNS = [  # the printed table, in nccl-tests' order: (column, title, width, format)
    ("size_bytes", "size(B)", 12, "d"),
    ("count", "count", 12, "d"),
    ("dtype", "type", 10, "s"),
    ("op", "redop", 7, "s"),
    ("root", "root", 6, "d"),
    ("algorithm", "algorithm", 18, "s"),
]
PLACEMENT_COLUMNS = [  # repeated for out-of-place, then in-place (nccl-tests' two groups)
    ("time_us", "time(us)", 11, ".1f"),
    ("algbw_gbps", "algbw(GB/s)", 12, ".3f"),
    ("busbw_gbps", "busbw(GB/s)", 12, ".3f"),
    ("wrong", "#wrong", 7, "d"),
    ("slowest_us", "slowest(us)", 12, ".1f"),
]
PLACEMENTS = ("out-of-place", "in-place")
FIT_COLUMNS = ["algorithm", "backend", "world_size", "alpha_us", "beta_gbps", "r2", "n_sizes", "min_bytes", "max_bytes",
               "collective"]


def combine_ranks(per_rank: list[list[dict]], meta: dict) -> pd.DataFrame:
    """One tidy row per (collective, size, algorithm): time averaged over ranks, #wrong summed.

    As nccl-tests does by default, ``time_us`` (and the bandwidths from it) is the mean of the
    ranks' mean times; ``slowest_us`` is the slowest rank's, which is what a job waits for.
    The collective, its op, root and bus-bandwidth factor come with the ranks' rows (from its
    plug-in); rows without them are all-reduce's (root -1: it has none, as nccl-tests prints).
    """
    world = len(per_rank)
    rows = []
    for i, first in enumerate(per_rank[0]):
        same = [rank_rows[i] for rank_rows in per_rank]
        seconds = sum(r["mean_s"] for r in same) / world
        algbw, busbw = bandwidths(first["size_bytes"], seconds, "all_reduce", world)
        if "busbw_factor" in first:
            busbw = algbw * first["busbw_factor"]
        wrong = [r["wrong"] for r in same]
        rows.append({
            "world_size": world,
            "size_bytes": first["size_bytes"],
            "count": first["count"],
            "dtype": meta["dtype"],
            "op": first.get("op", meta["op"]),
            "root": first.get("root", -1),
            "algorithm": first["algorithm"],
            "placement": first.get("placement", "in-place"),
            "time_us": seconds * 1e6,
            "slowest_us": max(r["mean_s"] for r in same) * 1e6,
            "cpu_us": sum(r.get("cpu_s", math.nan) for r in same) / world * 1e6,  # per rank, mean
            "algbw_gbps": algbw,
            "busbw_gbps": busbw,
            "wrong": -1 if min(wrong) < 0 else sum(wrong),
            "collective": first.get("collective", "all_reduce"),
            **{k: v for k, v in meta.items() if k not in ("dtype", "op")},
        })
    return pd.DataFrame(rows)


def format_table(df: pd.DataFrame) -> str:
    """nccl-tests-style fixed-width table: a line per (size, algorithm), out-of-place then
    in-place groups (#wrong -1, unchecked, prints N/A)."""
    return "\n".join([*header_lines(), format_rows(df)])


def header_lines() -> list[str]:
    key = sum(width for *_, width, _ in KEY_COLUMNS)
    group = sum(width for *_, width, _ in PLACEMENT_COLUMNS)
    spans = " " * key + "".join(p.center(group) for p in PLACEMENTS)
    titles = "".join(t.rjust(w) for _, t, w, _ in KEY_COLUMNS) + "".join(t.rjust(w) for _, t, w, _ in PLACEMENT_COLUMNS) * 2
    return [spans.rstrip(), titles]


def format_rows(df: pd.DataFrame) -> str:
    """The table's body lines for ``df`` (rows of one or more sizes)."""
    lines = []
    for _, part in df.groupby([*_collective(df), "size_bytes", "algorithm"], sort=False):
        by_place = {row.placement: row for row in part.itertuples(index=False)}
        first = next(iter(by_place.values()))
        cells = [_cell(getattr(first, k), w, f) for k, _, w, f in KEY_COLUMNS]
        for placement in PLACEMENTS:
            row = by_place.get(placement)
            cells += [_cell(None if row is None else getattr(row, k), w, f, k) for k, _, w, f in PLACEMENT_COLUMNS]
        lines.append("".join(cells))
    return "\n".join(lines)


def _cell(value, width: int, fmt: str, key: str = "") -> str:
    if value is None or (key == "wrong" and value < 0):
        return "N/A".rjust(width)
    return format(int(value) if fmt == "d" else value, fmt).rjust(width)


def footer_lines(df: pd.DataFrame) -> list[str]:
    """nccl-tests' closing lines: the bus bandwidth averaged over sizes and placements, per algorithm
    (of each collective, named where it is not all-reduce)."""
    lines = []
    for keys, part in df.groupby([*_collective(df), "algorithm"], sort=False):
        lines.append(f"# Avg bus bandwidth ({_label(*keys)}) : {part['busbw_gbps'].mean():.4f} GB/s")
    wrong = df.loc[df["wrong"] > 0, "wrong"].sum()
    lines.append(f"# Out of bounds values : {int(wrong)} {'OK' if wrong == 0 else 'FAILED'}")
    return lines


def fit_line(row) -> str:
    """The alpha-beta fit of one algorithm; "n/a" where the data cannot determine a term."""
    alpha = "n/a" if math.isnan(row.alpha_us) else f"{row.alpha_us:9.1f} us"
    if math.isnan(row.beta_gbps) or math.isinf(row.beta_gbps):
        beta = "n/a (time does not grow with size)" if math.isinf(row.beta_gbps) else "n/a"
    else:
        beta = f"{row.beta_gbps:8.3f} GB/s"
    r2 = "n/a" if math.isnan(row.r2) else f"{row.r2:.3f}"
    label = _label(getattr(row, "collective", "all_reduce"), row.algorithm)
    return f"#   {label:>17s}: alpha {alpha}, beta {beta}, R^2 {r2}"


def _collective(df: pd.DataFrame) -> list[str]:
    """The grouping column of the collective, where the rows have one (older CSVs do not)."""
    return ["collective"] if "collective" in df else []


def _label(*keys: str) -> str:
    """"ring" for all-reduce's ring (the table's name since the start), "all_gather ring" otherwise."""
    *collective, algorithm = keys
    return algorithm if collective in ([], ["all_reduce"]) else f"{collective[0]} {algorithm}"


def fit_table(df: pd.DataFrame) -> pd.DataFrame:
    """The alpha-beta model of each (collective, algorithm, backend, world size), least squares
    over sizes."""
    rows = []
    # The fit is of the in-place time, the collective itself (out of place may add a copy).
    if "placement" in df:
        df = df[df["placement"] == "in-place"]
    df = df if "collective" in df else df.assign(collective="all_reduce")
    for (collective, algorithm, backend, world), part in df.groupby(["collective", "algorithm", "backend", "world_size"], sort=False):
        alpha, beta, r2 = fit_alpha_beta(part["size_bytes"], part["time_us"] / 1e6)
        rows.append({
            "algorithm": algorithm, "backend": backend, "world_size": world, "alpha_us": alpha,
            "beta_gbps": beta, "r2": r2, "n_sizes": part["size_bytes"].nunique(),
            "min_bytes": part["size_bytes"].min(), "max_bytes": part["size_bytes"].max(), "collective": collective,
        })
    return pd.DataFrame(rows, columns=FIT_COLUMNS)


def write_outputs(df: pd.DataFrame, fits: pd.DataFrame, out_dir: str) -> dict[str, str]:
    """collectives.csv, alpha_beta.csv and busbw.png under ``out_dir``; returns their paths."""
    os.makedirs(out_dir, exist_ok=True)
    paths = {
        "results": os.path.join(out_dir, "collectives.csv"),
        "alpha_beta": os.path.join(out_dir, "alpha_beta.csv"),
        "figure": os.path.join(out_dir, "busbw.png"),
    }
    write_via(paths["results"], lambda p: df.to_csv(p, index=False))
    write_via(paths["alpha_beta"], lambda p: fits.to_csv(p, index=False))
    write_via(paths["figure"], lambda p: _figure(df, p))
    return paths


def _size_label(value: float) -> str:
    for unit, scale in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if value >= scale:
            return f"{value / scale:g}{unit}"
    return f"{value:g}"


def _figure(df: pd.DataFrame, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt
    import seaborn as sns
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    if "placement" in df:  # the collective itself; out of place may add a copy
        df = df[df["placement"] == "in-place"]
    several = "collective" in df and df["collective"].nunique() > 1
    grid = sns.relplot(
        data=df, x="size_bytes", y="busbw_gbps", hue="algorithm", col="world_size", row="collective" if several else None,
        kind="line", marker="o", height=3.5, aspect=1.2, facet_kws={"sharey": False},
    )
    grid.set(xlabel="message size (bytes)", ylabel="bus bandwidth (GB/s)")
    grid.set(ylim=(0, None))  # bandwidth from zero, so that ratios read true
    for ax in grid.axes.flat:  # sizes are powers of two: label them 4K, 64M as the CLI takes them
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_locator(LogLocator(base=2, numticks=10))
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: _size_label(v)))
        ax.xaxis.set_minor_formatter(NullFormatter())
    grid.set_titles("{row_name}, world size {col_name}" if several else "world size {col_name}")
    what = "collectives'" if several else df.get("collective", pd.Series(["all_reduce"])).iloc[0].replace("_", "-")
    grid.figure.suptitle(f"In-place {what} bus bandwidth, {df['backend'].iloc[0]}, {df['dtype'].iloc[0]}", y=1.03)
    grid.savefig(path, format="png", dpi=110, bbox_inches="tight")
    plt.close(grid.figure)
