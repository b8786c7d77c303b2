"""The step broken down by parallel axis: its data (pure pandas) and its figure.

As the DDP breakdown stacks a step's phases, this stacks the median step of each layout
(tp x pp x dp) by the axis whose collectives held the training thread: tensor parallelism's
all-reduces, all-gathers and reduce-scatters (on CPU all of them block), the pipeline's bubble
(the schedule's own idle time, replayed from the measured compute) and the rest of its sends and
receives, the data-parallel reduction left exposed after backward, then the optimizer and the
rest (compute, and what no axis claims). The segments add up to the median step.
"""

from __future__ import annotations

import pandas as pd

from commlab.sweep import figdata

SEGMENTS = ["tensor", "bubble", "pipeline", "data", "optimizer", "compute"]
NAMES = {"tensor": "tensor parallel (TP collectives)", "bubble": "pipeline bubble (schedule idle)",
         "pipeline": "pipeline (send/recv)",
         "data": "data parallel (exposed reduction)", "optimizer": "optimizer", "compute": "compute and the rest"}
_TP = ["tp_all_reduce_median", "tp_all_gather_median", "tp_reduce_scatter_median"]


def axis_breakdown(runs: pd.DataFrame) -> pd.DataFrame:
    """One bar per configuration, ``bar`` its layout (``tp 2 x pp 1 x dp 1``), one segment per axis
    (:data:`SEGMENTS`, seconds), ``step`` and its q1-q3, and ``panel`` (what else varies).

    Empty unless the results have the per-axis columns and a layout with tp or pp above one.
    """
    df = figdata.ok(runs)
    if df.empty or not set(_TP) <= set(df) or "tp" not in df or not ((df["tp"] > 1) | (df["pp"] > 1)).any():
        return df.iloc[0:0]
    df = df[df[_TP].notna().all(axis=1)].copy()
    df["tensor"] = df[_TP].sum(axis=1)
    # The bubble is spent waiting on receives: the part of the send/recv seconds it explains
    # (results from before the column have none).
    bubble = df["pp_bubble_median"].fillna(0.0) if "pp_bubble_median" in df else pd.Series(0.0, index=df.index)
    df["bubble"] = bubble.clip(upper=df["pp_send_recv_median"])
    df["pipeline"] = df["pp_send_recv_median"] - df["bubble"]
    df["data"] = df["exposed_comm_median"]
    df["optimizer"] = df["optimizer_median"]
    df["step"], df["step_lo"], df["step_hi"] = df["step_median"], df["step_q1"], df["step_q3"]
    df["compute"] = df["step"] - df[SEGMENTS[:-1]].sum(axis=1)
    df["dp"] = df["world_size"] // (df["tp"] * df["pp"])
    # A pipeline's micro-batches and schedule belong to its bar: one stage has neither.
    inner = ("world_size", "tp", "pp", "microbatches", "schedule")
    outer = figdata.context(df, [a for a in figdata.AXES if a not in inner])
    df["panel"] = df.apply(lambda r: figdata.label(r, outer), axis=1)
    df["bar"] = df.apply(lambda r: f"tp {r['tp']} x pp {r['pp']} x dp {r['dp']}" + (
        f"\nm {r['microbatches']}, {r['schedule']}" if r["pp"] > 1 and "microbatches" in r else ""), axis=1)
    figdata.one_per_cell(df, ["panel", "bar"])
    df = df.sort_values([*outer, "world_size", "pp", "tp"], kind="stable")
    return df[["config", "panel", "bar", "tp", "pp", "dp", *SEGMENTS, "step", "step_lo", "step_hi"]]


def draw(df: pd.DataFrame):
    """The stacked bars of :func:`axis_breakdown`, one panel per ``panel``; None when empty."""
    if df.empty:
        return None
    import matplotlib.pyplot as plt
    import seaborn as sns

    colors = dict(zip(SEGMENTS, sns.color_palette("deep", len(SEGMENTS))))
    panels = list(dict.fromkeys(df["panel"]))
    fig, axes = plt.subplots(1, len(panels), figsize=(max(4.2, 1.5 * df.groupby("panel").size().max()) * len(panels), 3.4),
                             squeeze=False, sharey=True)
    for ax, panel in zip(axes[0], panels):
        part = df[df["panel"] == panel]
        bottom = pd.Series(0.0, index=part.index)
        for seg in SEGMENTS:
            ax.bar(part["bar"], part[seg] * 1e3, bottom=bottom * 1e3, color=colors[seg], label=NAMES[seg])
            bottom += part[seg]
        ax.errorbar(part["bar"], part["step"] * 1e3, yerr=[(part["step"] - part["step_lo"]) * 1e3,
                    (part["step_hi"] - part["step"]) * 1e3], fmt="none", ecolor="black", capsize=3)
        ax.set_title(panel)
        ax.set_ylabel(f"{figdata.STATISTIC} (ms)", fontsize=8)
        ax.tick_params(axis="x", labelsize=7)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles[::-1], labels[::-1], loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize=8)
    fig.suptitle("The median step by parallel axis")
    fig.text(0.5, -0.02, "Each bar: the median of each iteration's slowest-rank step, split by the axis whose "
             "collectives blocked it (whisker: the steps' q1-q3).", ha="center", va="top", fontsize=7)
    fig.tight_layout()
    return fig
