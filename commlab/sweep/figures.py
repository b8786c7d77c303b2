"""Drawing a sweep's figures (seaborn style, PNG and PDF) from its CSVs, only those the data supports.

The first five follow the evaluation of the DDP paper (Li et al., VLDB 2020, section 5):

    breakdown        the median step's segments, stacked, with and without overlap
    bucket_size      the median step vs bucket size, q1-q3 band
    scaling          throughput vs world size with the ideal line, and efficiency
    no_sync          latency per micro-batch vs accumulation steps (skipping synchronisation)
    round_robin      step latency vs round-robin process groups
    timeline         one iteration's buckets: ready, launched, done vs backward compute
    sharded          a grid over ZeRO stages: step time, peak memory and exposed collectives
    axes             the median step by parallel axis (tp x pp x dp layouts; commlab/sweep/figaxes.py)

Every one reports the statistic the console prints (commlab.runs.stats.median_step): per
iteration the slowest rank's step, the median over iterations, q1-q3 as the band.
"""

from __future__ import annotations

import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only; never needs a display

import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.lines import Line2D  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402
import pandas as pd  # noqa: E402
import seaborn as sns  # noqa: E402

from commlab.sweep import figaxes, figdata  # noqa: E402
from commlab.runs.stats import summarise  # noqa: E402
from commlab.runs.store import read_metadata, read_tables  # noqa: E402

_NAMES = {"accumulate_time": "no_sync micro-batches", "forward": "forward", "backward_compute": "backward compute",
          "exposed_comm": "exposed comm", "optimizer": "optimizer", "other": "other (rest of the step)"}


def draw_all(run_dir: Path, echo=lambda line: print(line, file=sys.stderr)) -> list[Path]:
    """Redraw every supported figure under ``run_dir/figures``; return the files written.

    A figure whose data cannot be drawn honestly (two configurations in one cell) is skipped
    with a line through ``echo`` saying why.
    """
    run_dir = Path(run_dir)
    iterations, buckets, runs = read_tables(run_dir)
    runs = summarise(runs, iterations)  # the statistic of today's console, whichever commlab wrote runs.csv
    # A prediction (commlab predict) says so under every figure, with its assumptions.
    note = read_metadata(run_dir).get("figure_note")
    out = run_dir / "figures"
    sns.set_theme(style="whitegrid", context="paper")
    written: list[Path] = []
    drawers = [
        ("breakdown", lambda: _breakdown(figdata.breakdown(runs), measured=not note)),
        ("bucket_size", lambda: _curve(figdata.curve(runs, "bucket_mb", 1e3), "bucket_mb", "bucket cap (MiB)", "median step (ms)", "Median step against bucket size", log=True)),
        ("scaling", lambda: _scaling(figdata.scaling(runs))),
        ("no_sync", lambda: _curve(figdata.curve(runs, "accumulate", 1e3), "accumulate", "micro-batches per synchronisation (no_sync)", "median step / micro-batches (ms)", "Skipping synchronisation: median step per micro-batch")),
        ("round_robin", lambda: _curve(figdata.curve(runs, "groups", 1e3), "groups", "round-robin process groups", "median step (ms)", "Median step against round-robin process groups")),
        ("timeline", lambda: _timeline(iterations, buckets, figdata.pick_timeline_config(runs, buckets))),
        ("sharded", lambda: _sharded(figdata.sharded(runs))),
        ("axes", lambda: figaxes.draw(figaxes.axis_breakdown(runs))),
    ]
    for name, draw in drawers:
        try:
            fig = draw()
        except ValueError as err:
            echo(f"figure {name} not drawn: {err}")
            fig = None
        if fig is None:  # not supported by this data: drop a stale copy from an earlier draw
            for suffix in (".png", ".pdf"):
                (out / f"{name}{suffix}").unlink(missing_ok=True)
            continue
        out.mkdir(parents=True, exist_ok=True)
        if note:
            fig.text(0.01, -0.02, note, fontsize=6, va="top", wrap=True)
        for suffix in (".png", ".pdf"):
            save(fig, out / f"{name}{suffix}")
            written.append(out / f"{name}{suffix}")
        plt.close(fig)
    return written


def save(fig, path: Path) -> None:
    """Write ``fig`` atomically, with no creation date, so the same data gives the same bytes
    (committed reference figures then change only when their data does)."""
    from commlab._atomic import write_via

    meta = {"CreationDate": None} if path.suffix == ".pdf" else {}
    write_via(path, lambda tmp: fig.savefig(tmp, format=path.suffix[1:], dpi=130, bbox_inches="tight", metadata=meta))


def _panels(n: int, width: float = 4.2, height: float = 3.4, sharey: bool = False):
    cols = min(n, 3)
    rows = (n + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(width * cols, height * rows), squeeze=False, sharey=sharey)
    for ax in axes.flat[n:]:
        ax.set_visible(False)
    return fig, list(axes.flat[:n])


def _breakdown(df: pd.DataFrame, measured: bool = True):
    """``measured=False`` (a prediction): its own note replaces the footnote (see :func:`draw_all`)."""
    if df.empty:
        return None
    # Every segment is stacked (a bar is the whole step); one too thin to see stays out of the legend.
    thin = {s for s in figdata.SEGMENTS if df[s].abs().sum() <= 0.005 * df["step"].sum()}
    colors = dict(zip(figdata.SEGMENTS, sns.color_palette("deep", len(figdata.SEGMENTS))))
    panels = list(dict.fromkeys(df["panel"]))
    fig, axes = _panels(len(panels), width=max(4.2, 0.9 * df.groupby("panel").size().max()), sharey=True)
    for ax, panel in zip(axes, panels):
        part = df[df["panel"] == panel]
        bottom = pd.Series(0.0, index=part.index)
        for seg in figdata.SEGMENTS:
            ax.bar(part["bar"], part[seg] * 1e3, bottom=bottom * 1e3, color=colors[seg],
                   label="_nolegend_" if seg in thin else _NAMES[seg])
            bottom += part[seg]
        if (part["step_hi"] > part["step_lo"]).any():  # the steps' q1-q3
            ax.errorbar(part["bar"], part["step"] * 1e3, yerr=[(part["step"] - part["step_lo"]) * 1e3,
                        (part["step_hi"] - part["step"]) * 1e3], fmt="none", ecolor="black", capsize=3)
        ax.set_title(panel)
        ax.set_ylabel(f"{figdata.STATISTIC} (ms)", fontsize=8)
        ax.tick_params(axis="x", labelsize=7)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles[::-1], labels[::-1], loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize=8)
    fig.suptitle("The median step by phase, with and without overlapping communication")
    if measured:
        fig.text(0.5, -0.02, "Each bar: the median over the measured iterations of each iteration's slowest-rank step, "
                 "split into that step's phases; 'other' is the rest of the step"
                 + (" (whisker: the steps' q1-q3)." if (df["step_hi"] > df["step_lo"]).any() else "."),
                 ha="center", va="top", fontsize=7)
    fig.tight_layout()
    return fig


def _curve(df: pd.DataFrame, x: str, xlabel: str, ylabel: str, title: str, log: bool = False):
    if df.empty:
        return None
    panels = list(dict.fromkeys(df["panel"]))
    # Each panel its own y axis: world sizes 8 and 256 differ several-fold, and a shared axis
    # either clips the slow panel or flattens the fast one.
    fig, axes = _panels(len(panels))
    for ax, panel in zip(axes, panels):
        part = df[df["panel"] == panel]
        banded = bool((part["q3"] > part["q1"]).any())
        for (series, s), color in zip(part.groupby("series", sort=True), sns.color_palette("deep")):
            if banded:
                ax.fill_between(s[x], s["q1"], s["q3"], color=color, alpha=0.2, linewidth=0)
            # Error bars: the spread of the repetitions' medians (--repeat), i.e. the drift.
            yerr = [s["median"] - s["spread_lo"], s["spread_hi"] - s["median"]] if (s["repetitions"] > 1).any() else None
            ax.errorbar(s[x], s["median"], yerr=yerr, marker="o", color=color, capsize=3,
                        label=series if part["series"].nunique() > 1 else None)
        if log:
            ax.set_xscale("log")
        ax.set_xticks(sorted(part[x].unique()), labels=[f"{v:g}" for v in sorted(part[x].unique())])
        ax.minorticks_off()
        ax.set_title(panel)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.set_ylim(bottom=0)
        ax.yaxis.set_tick_params(labelleft=True)
        reps = int(part["repetitions"].max())
        key = ", ".join(["median"] + (["band q1-q3"] if banded else [])
                        + ([f"bars: min-max of {reps} repetitions' medians"] if reps > 1 else []))
        if part["series"].nunique() > 1:
            ax.legend(fontsize=7, title=key, title_fontsize=7)
        else:  # one series needs no legend, but the band and bars still need saying
            ax.text(0.02, 0.02, key, transform=ax.transAxes, fontsize=7, va="bottom")
    fig.suptitle(f"{title}\n(step: slowest rank per iteration)", fontsize=10)
    fig.tight_layout()
    return fig


def _scaling(df: pd.DataFrame):
    if df.empty:
        return None
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.6))
    banded = bool((df["samples_q3"] > df["samples_q1"]).any())
    for (series, s), color in zip(df.groupby("series", sort=True), sns.color_palette("deep")):
        yerr = [s["samples_per_s"] - s["samples_lo"], s["samples_hi"] - s["samples_per_s"]] if (s["repetitions"] > 1).any() else None
        if banded:
            left.fill_between(s["world_size"], s["samples_q1"], s["samples_q3"], color=color, alpha=0.2, linewidth=0)
        left.errorbar(s["world_size"], s["samples_per_s"], yerr=yerr, marker="o", color=color, capsize=3, label=series)
        left.plot(s["world_size"], s["ideal"], linestyle="--", color=color, alpha=0.6)
        right.plot(s["world_size"], s["scaling_efficiency"], marker="o", color=color, label=series)
    right.axhline(1.0, color="gray", linestyle="--", linewidth=1)
    above = df[df["scaling_efficiency"] > 1.0]
    if not above.empty:  # above linear on one machine is a warning sign, not a result
        right.scatter(above["world_size"], above["scaling_efficiency"], s=90, facecolors="none",
                      edgecolors="red", linewidths=1.5, zorder=5, label="> 1: check load / threads")
        right.legend(fontsize=7)
    ticks = sorted(df["world_size"].unique())
    # World sizes double (2, 4, ..., 256): on a linear axis the small ones collide ("816"); on a
    # log-2 axis they are evenly spaced and each keeps its plain label.
    spread = ticks[-1] / ticks[0] >= 8
    for ax, ylabel in ((left, "samples / s at the median step\n(" + ("band: at the steps' q1-q3; " if banded else "") + "dashed: ideal)"),
                       (right, "scaling efficiency (median step)")):
        if spread:
            ax.set_xscale("log", base=2)
        ax.set_xticks(ticks, labels=[f"{t:g}" for t in ticks])
        ax.minorticks_off()
        ax.set_xlabel("world size (processes)")
        ax.set_ylabel(ylabel)
        ax.set_ylim(bottom=0)
    reps = int(df["repetitions"].max())
    left.legend(fontsize=7, title=f"bars: min-max of {reps} repetitions' medians" if reps > 1 else None, title_fontsize=7)
    fig.suptitle(f"Scaling: throughput against linear, and efficiency; {figdata.STATISTIC}")
    fig.tight_layout()
    return fig


def _timeline(iterations: pd.DataFrame, buckets: pd.DataFrame, config: str | None):
    if config is None:
        return None
    row, bks = figdata.timeline(iterations, buckets, config)
    fig, ax = plt.subplots(figsize=(8, 1.2 + 0.32 * (len(bks) + 2)))
    ms = 1e3
    fwd_end = row["forward"]
    bwd_end = fwd_end + row["backward_compute"]
    palette = sns.color_palette("deep")
    ax.barh("forward", row["forward"] * ms, left=0, color=palette[1])
    ax.barh("backward compute", (bwd_end - fwd_end) * ms, left=fwd_end * ms, color=palette[2])
    for _, b in bks.iterrows():
        name = f"bucket {int(b['bucket'])} ({_size(b['nbytes'])})"
        ax.barh(name, (b["launched"] - b["ready"]) * ms, left=b["ready"] * ms, color="lightgray")
        # Launched but behind the group's previous all-reduce: queued in the backend, not moving.
        ax.barh(name, (b["started"] - b["launched"]) * ms, left=b["launched"] * ms, color="white",
                edgecolor=palette[3], hatch="////", linewidth=0.5)
        ax.barh(name, (b["done"] - b["started"]) * ms, left=b["started"] * ms, color=palette[3])
        ax.plot([b["ready"] * ms], [name], marker="|", color="black", markersize=10)
    ax.axvline(bwd_end * ms, color="gray", linestyle="--", linewidth=1)
    ax.invert_yaxis()
    ax.set_xlabel("time since forward start (ms)")
    ax.set_title(f"One iteration's buckets: {config}, rank {int(row['rank'])}, iteration {int(row['iteration'])}: "
                 f"the {figdata.STATISTIC}", fontsize=8)
    # A state enters the legend only where a bar of it can be seen (wider than 0.2% of the axis).
    visible = 0.002 * max(bwd_end, bks["done"].max() if not bks.empty else 0.0)
    waited = bool(((bks["launched"] - bks["ready"]) > visible).any())
    queued = bool(((bks["started"] - bks["launched"]) > visible).any())
    legend = [Patch(color=palette[1], label="forward"), Patch(color=palette[2], label="backward compute"),
              *([Patch(color="lightgray", label="bucket ready, waiting to launch")] if waited else []),
              *([Patch(facecolor="white", edgecolor=palette[3], hatch="////", linewidth=0.5,
                       label="launched, queued behind the group's previous all-reduce")] if queued else []),
              Patch(color=palette[3], label="all-reduce transferring"),
              Line2D([], [], color="black", marker="|", linestyle="none", markersize=10, label="bucket ready"),
              Line2D([], [], color="gray", linestyle="--", label="end of backward compute")]
    ax.legend(handles=legend, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=7)
    return fig


def _sharded(df: pd.DataFrame):
    """Per panel, a group of bars per stage (figdata.sharded's ``position``), one per bucket size side
    by side (no series hides another; one bucket size is still a bar chart): the median step with
    q1-q3 whiskers where the steps spread, peak MiB written on the bars, exposed seconds stacked."""
    if df.empty:
        return None
    panels, caps = list(dict.fromkeys(df["panel"])), sorted(df["bucket_mb"].unique())
    width = 0.8 / len(caps)
    deep = sns.color_palette("deep")
    series_colors = dict(zip(dict.fromkeys(df["series"]), deep))  # one bucket size: a colour per stage
    fig, axes = plt.subplots(len(panels), 3, figsize=(13, 3.8 * len(panels)), squeeze=False)
    for row, panel in zip(axes, panels):
        part = df[df["panel"] == panel]
        x = part["position"] + (part["bucket_mb"].map(caps.index) - (len(caps) - 1) / 2) * width
        colors = [series_colors[s] if len(caps) == 1 else deep[caps.index(b) % len(deep)]
                  for s, b in zip(part["series"], part["bucket_mb"])]
        banded = bool((part["step_q3"] > part["step_q1"]).any())
        row[0].bar(x, part["step_median"] * 1e3, width, color=colors)
        if banded:
            row[0].errorbar(x, part["step_median"] * 1e3, yerr=[(part["step_median"] - part["step_q1"]) * 1e3, (part["step_q3"] - part["step_median"]) * 1e3], fmt="none", ecolor="black", capsize=3)  # noqa: E501
        peaks = row[1].bar(x, part["peak_bytes"] / 2**20, width, color=colors)
        row[1].bar_label(peaks, fmt="%.1f", fontsize=7 if len(caps) == 1 else 6, padding=2)
        row[2].bar(x, part["exposed_allgather"] * 1e3, width, color=deep[0],
                   label="exposed all-gather (median over iterations, then ranks)")
        tops = row[2].bar(x, part["exposed_reduction"] * 1e3, width, bottom=part["exposed_allgather"] * 1e3,
                          color=deep[3], label="exposed reduction in the median step (DDP: all-reduce)")
        if len(caps) > 1:  # which bar is which bucket size, as the colours say in the other two
            row[2].bar_label(tops, labels=[f"{b:g}" for b in part["bucket_mb"]], fontsize=6, padding=2)
        names = part.drop_duplicates("position").sort_values("position")
        title = panel if len(caps) > 1 else f"{panel}, {caps[0]:g} MiB buckets"
        for ax, ylabel in ((row[0], "median step (ms)" + (", whiskers q1-q3" if banded else "")),
                           (row[1], "peak bytes per rank (MiB)"),
                           (row[2], "exposed per step (ms)" + (", on top: bucket MiB" if len(caps) > 1 else ""))):
            ax.set_xticks(names["position"], labels=names["series"], fontsize=7, rotation=20 if len(names) > 4 else 0)
            ax.set_title(title, fontsize=8)
            ax.set_ylabel(ylabel)
            ax.set_ylim(bottom=0)
        row[1].set_ylim(0, 1.15 * df["peak_bytes"].max() / 2**20)  # one scale for every panel; room for the numbers
        row[2].set_ylim(0, 1.35 * max((part["exposed_allgather"] + part["exposed_reduction"]).max() * 1e3, 1e-3))
        row[2].legend(fontsize=7, loc="upper left")
        if len(caps) > 1:
            row[0].legend(handles=[Patch(color=deep[i % len(deep)], label=f"{c:g} MiB") for i, c in enumerate(caps)], title="bucket cap", fontsize=7, title_fontsize=7)  # noqa: E501
    fig.suptitle(f"Sharded data parallelism by stage: {figdata.STATISTIC}, measured peak memory, exposed collectives")
    fig.tight_layout()
    return fig


def _size(nbytes: float) -> str:
    return f"{nbytes / 2**20:.1f} MiB" if nbytes >= 2**20 else f"{nbytes / 2**10:.0f} KiB"
