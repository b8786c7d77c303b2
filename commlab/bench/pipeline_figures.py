"""Figures of a pipeline benchmark, drawn from its tidy CSVs into its ``figures/`` directory (matplotlib Agg, seaborn).

- ``throughput.png``: samples/s vs micro-batches, one line per schedule, commlab solid, torch dashed;
- ``activation_memory.png``: bytes saved for backward per stage, one bar per schedule;
- ``peak_memory.png``: each rank's measured peak of held bytes (the executor's ledger: stashes, receive
  buffers, sends in flight, hand-overs), one bar per schedule, at the most micro-batches;
- ``timeline.png``: for each schedule, the measured timeline of a median step over the simulator's
  Gantt chart from the measured per-stage times.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from commlab._atomic import write_via
from commlab.pipeline.schedule.render import gantt_figure
from commlab.pipeline.schedule.actions import Action
from commlab.pipeline.schedule.simulate import Timed


def draw_all(run_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    run_dir = Path(run_dir)
    summary = pd.read_csv(run_dir / "summary.csv")
    stages = pd.read_csv(run_dir / "stages.csv")
    timeline = pd.read_csv(run_dir / "timeline.csv")
    figures = run_dir / "figures"
    figures.mkdir(parents=True, exist_ok=True)
    written = [_throughput(summary, figures / "throughput.png"), _memory(stages, figures / "activation_memory.png"),
               _peaks(stages, figures / "peak_memory.png")]  # fmt: skip
    written.append(_timelines(summary, timeline, figures / "timeline.png"))
    return written


def _plain(df: pd.DataFrame) -> pd.DataFrame:
    """The configurations without checkpointing, with the most common balance mode."""
    df = df[df["checkpoint"] == "never"]
    return df[df["balance_mode"] == df["balance_mode"].mode().iloc[0]] if len(df) else df


def _throughput(summary: pd.DataFrame, path: Path) -> Path:
    import matplotlib.pyplot as plt
    import seaborn as sns

    df = _plain(summary)
    long = [df.assign(implementation="commlab", samples_per_s=df["commlab_samples_per_s"])]
    if "torch_samples_per_s" in df:
        long.append(df.assign(implementation="torch", samples_per_s=df["torch_samples_per_s"]))
    data = pd.concat(long).dropna(subset=["samples_per_s"])
    fig, ax = plt.subplots(figsize=(5.5, 3.8))
    sns.lineplot(data=data, x="microbatches", y="samples_per_s", hue="schedule", style="implementation", marker="o", ax=ax)
    ax.set_xscale("log", base=2)
    counts = sorted(int(m) for m in data["microbatches"].unique())
    ax.set_xticks(counts, [str(m) for m in counts])  # plain integers, not 2^1, 2^2
    ax.xaxis.set_minor_locator(plt.NullLocator())
    ax.set_xlabel("micro-batches per mini-batch")
    ax.set_ylabel("samples / s")
    ax.set_ylim(bottom=0)
    ax.set_title("Pipeline throughput against micro-batches", fontsize=10)
    fig.tight_layout()
    write_via(path, lambda tmp: fig.savefig(tmp, format="png", dpi=120))
    plt.close(fig)
    return path


def _memory(stages: pd.DataFrame, path: Path) -> Path:
    df = _last_m(stages)
    return _bars(df.assign(MiB=df["saved_bytes"] / 2**20), "stage", "pipeline stage", "MiB saved for backward (peak)",
                 f"Per-stage activation memory, {int(df['microbatches'].max())} micro-batches", path)


def _peaks(stages: pd.DataFrame, path: Path) -> Path:
    df = _last_m(stages).drop_duplicates(["config", "rank"])  # one row per rank
    return _bars(df.assign(MiB=df["rank_peak_bytes"] / 2**20), "rank", "pipeline rank", "measured peak MiB held",
                 f"Peak memory per rank and schedule, {int(df['microbatches'].max())} micro-batches", path)


def _last_m(stages: pd.DataFrame) -> pd.DataFrame:
    """The stage rows of the largest micro-batch count (where the schedules' memory differs most)."""
    df = _plain(stages)
    return df[df["microbatches"] == df["microbatches"].max()]


def _bars(df: pd.DataFrame, x: str, xlabel: str, ylabel: str, title: str, path: Path) -> Path:
    """MiB per ``x``, one bar per schedule."""
    import matplotlib.pyplot as plt
    import seaborn as sns

    fig, ax = plt.subplots(figsize=(5.5, 3.8))
    sns.barplot(data=df, x=x, y="MiB", hue="schedule", ax=ax)
    ax.set_ylabel(ylabel)
    ax.set_xlabel(xlabel)
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    write_via(path, lambda tmp: fig.savefig(tmp, format="png", dpi=120))
    plt.close(fig)
    return path


def _timelines(summary: pd.DataFrame, timeline: pd.DataFrame, path: Path) -> Path:
    df = _plain(summary)
    panels = []
    ranks = int(timeline["rank"].max()) + 1
    for schedule, group in df.groupby("schedule", sort=False):
        config = group.sort_values("microbatches")["config"].iloc[-1]
        rows = timeline[timeline["config"] == config]
        for source in ("simulated", "measured"):
            part = rows[rows["source"] == source]
            ms = [Timed(int(r.rank), Action(int(r.stage), r.kind, int(r.microbatch)), r.start * 1e3, r.end * 1e3)
                  for r in part.itertuples()]  # fmt: skip
            panels.append((f"{config}: {source}", ms))
    gantt_figure(panels, ranks, str(path), unit="ms")
    return path
