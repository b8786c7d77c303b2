"""Figure data: the tables each figure draws, cut from the tidy results (pure pandas).

Each function returns an empty frame when the results cannot support its figure (for example a
bucket-size curve needs at least two bucket sizes), so the drawing code draws only what the
data supports.
"""

from __future__ import annotations

import pandas as pd

from commlab.runs import stats

# The axes a sweep can vary, in the order a label names them.
AXES = ["model", "model_args", "backend", "world_size", "algorithm", "bucket_mb", "overlap", "accumulate", "groups", "threads",
        "scaling", "optim", "stage", "prefetch", "reshard", "tp", "pp", "microbatches", "schedule", "shard_group"]
# Settings that are not meant to vary within a figure; when a results directory holds two
# configurations that differ only in these (say, a grid resumed with other --iters), they become
# a series of their own rather than two points in one cell.
SETTINGS = ["global_batch", "batch_per_rank", "iters", "warmup"]
# Stacked segments of one step, bottom to top; section 5 of the paper splits an iteration the same
# way (forward, backward compute, exposed communication, optimizer). "other" is the rest of the
# step, so the stack adds up to the median step (see commlab.runs.stats.median_step).
SEGMENTS = [*stats.SEGMENTS, "other"]
# What every figure and the console report (commlab.runs.stats.median_step), in words.
STATISTIC = "median step (slowest rank per iteration)"


def ok(runs: pd.DataFrame) -> pd.DataFrame:
    df = runs[(runs["status"] == "ok") & runs["step_median"].notna()].copy()
    # Results written before --repeat existed: one repetition, no spread across repetitions.
    # (Tables built by hand without quartiles: no band.)
    for column, default in (("repetitions", 1), ("step_spread_lo", df["step_median"]), ("step_spread_hi", df["step_median"]),
                            ("step_q1", df["step_median"]), ("step_q3", df["step_median"])):
        if column not in df:
            df[column] = default
    return df


def varying(df: pd.DataFrame, columns: list[str]) -> list[str]:
    """The columns among ``columns`` that take more than one value in ``df``."""
    return [c for c in columns if c in df and df[c].nunique(dropna=False) > 1]


def label(row: pd.Series, columns: list[str]) -> str:
    """A short human label of a row's values in ``columns``, e.g. ``gloo, w2, overlap``."""
    parts = []
    for c in columns:
        v = row[c]
        if c == "overlap":
            parts.append("overlap" if _truthy(v) else "no overlap")
        elif c == "world_size":
            parts.append(f"w{v}")
        elif c == "bucket_mb":
            parts.append(f"{v:g} MiB")
        elif c == "threads":
            parts.append(f"{v} thread{'s' if int(v) != 1 else ''}/rank")
        elif c == "stage":
            parts.append("DDP" if int(v) == 0 else f"stage {v}")
        elif c == "shard_group":
            if int(v):  # hybrid sharding (HSDP) over groups of v ranks; 0: sharded over every rank
                parts.append(f"HSDP {v}")
        elif c == "reshard":
            parts.append("reshard" if _truthy(v) else "no reshard")
        elif c == "optim":
            parts.append({"sgd": "SGD", "adam": "Adam"}.get(str(v), str(v)))
        elif c in ("accumulate", "groups", "prefetch", "tp", "pp", "microbatches", *SETTINGS):
            parts.append(f"{c} {v}")
        else:
            parts.append(str(v))
    return ", ".join(parts) or "all"


def breakdown(runs: pd.DataFrame) -> pd.DataFrame:
    """The median step of each configuration split into its segments (seconds), with its q1-q3,
    and ``panel`` and ``bar`` labels.

    The segments are the median step's phases (:func:`stats.median_step`), ``other`` included,
    so they add up to ``step``, the median step the console prints. Panels split by whatever
    varies besides bucket size and overlap; bars within a panel are bucket size x overlap, so
    with and without overlap stand next to each other.
    """
    df = ok(runs)
    if df.empty or "other_median" not in df:  # results summarised before the median step had parts
        return df.iloc[0:0]
    df = df.drop(columns=[c for c in (*SEGMENTS, "step", "step_lo", "step_hi") if c in df])
    for seg in SEGMENTS:
        df[seg] = df[f"{seg}_median"]
    df["step"], df["step_lo"], df["step_hi"] = df["step_median"], df["step_q1"], df["step_q3"]
    outer = context(df, [a for a in AXES if a not in ("bucket_mb", "overlap")])
    df["panel"] = df.apply(lambda r: label(r, outer), axis=1)
    both = df.groupby("panel")["overlap"].transform(lambda v: v.map(_truthy).nunique() > 1)
    if both.any():  # the figure is about overlap: keep the panels that can compare it
        df = df[both].copy()
    hidden = _hidden(df, ["panel", "bucket_mb", "overlap"])  # e.g. the same bars measured with other --iters
    df["bar"] = df.apply(lambda r: "\n".join(filter(None, [
        f"{r['bucket_mb']:g} MiB", "overlap" if _truthy(r["overlap"]) else "no overlap", label(r, hidden) if hidden else ""])), axis=1)
    one_per_cell(df, ["panel", "bar"])
    # Panels in the order of their values (w8, w16, ... numerically), not of their labels as text.
    order = [*outer, "bucket_mb", "overlap"]
    df = df.sort_values(order, ascending=[True] * (len(order) - 1) + [False], kind="stable")
    return df[["config", "panel", "bar", *SEGMENTS, "step", "step_lo", "step_hi"]]


def curve(runs: pd.DataFrame, x: str, per: float = 1.0) -> pd.DataFrame:
    """The median step and its q1-q3 band against axis ``x`` (needs two or more x values).

    ``panel`` splits by model, backend and world size (the paper draws one panel per backend and
    model); ``series`` by the other axes that vary. With ``x="accumulate"`` the times are per
    micro-batch (step / accumulate), which is how the paper compares no_sync intervals.
    """
    df = ok(runs)
    if df.empty or df[x].nunique() < 2:
        return df.iloc[0:0]
    scale = df["accumulate"] if x == "accumulate" else 1.0
    for stat in ("median", "q1", "q3", "spread_lo", "spread_hi"):
        df[stat] = df[f"step_{stat}"] / scale * per
    panels = context(df, [a for a in ("model", "model_args", "backend", "world_size") if a != x])
    series = varying(df, [a for a in AXES if a not in panels and a not in ("model", "model_args", "backend", "world_size", x)])
    df["panel"] = df.apply(lambda r: label(r, panels), axis=1)
    df["series"] = df.apply(lambda r: label(r, series + _hidden(df, ["panel", x])), axis=1)
    df = _curves_only(df, ["panel", "series"], x)
    one_per_cell(df, ["panel", "series", x])
    df = df.sort_values([*panels, "series", x], kind="stable")  # panels by value: w8 before w16
    return df[["config", "panel", "series", x, "median", "q1", "q3", "spread_lo", "spread_hi", "repetitions"]]


def scaling(runs: pd.DataFrame) -> pd.DataFrame:
    """Throughput at the median step and efficiency against world size, with the ideal (linear)
    throughput; ``samples_q1``/``samples_q3``: the throughput at the steps' q3 and q1 (the band),
    ``samples_lo``/``samples_hi`` at the repetitions' slowest and fastest median steps.

    ``ideal`` extends the smallest world size's throughput linearly; needs two or more world
    sizes. ``series`` names the scaling mode and every other axis that varies.
    """
    df = ok(runs)
    if df.empty or df["world_size"].nunique() < 2:
        return df.iloc[0:0]
    # The batch columns follow the world size within a scaling series; the others name series.
    keys = varying(df, [a for a in AXES if a != "world_size"])
    keys = ["scaling", *[k for k in keys if k != "scaling"]]
    df["series"] = df.apply(lambda r: label(r, keys), axis=1)
    df["series"] = df.apply(lambda r: label(r, keys + _hidden(df, ["series", "world_size"], ["iters", "warmup"])), axis=1)
    df = _curves_only(df, ["series"], "world_size")
    if df.empty:
        return df
    one_per_cell(df, ["series", "world_size"])
    # Throughput is inverse to step time: the slowest repetition gives the low end.
    samples = df["global_batch"] * df["accumulate"]
    df["samples_lo"], df["samples_hi"] = samples / df["step_spread_hi"], samples / df["step_spread_lo"]
    df["samples_q1"], df["samples_q3"] = samples / df["step_q3"], samples / df["step_q1"]
    parts = []
    for _, s in df.groupby("series", sort=True):
        base = s.loc[s["world_size"].idxmin()]
        s = s.assign(ideal=base["samples_per_s"] * s["world_size"] / base["world_size"])
        parts.append(s.sort_values("world_size"))
    out = pd.concat(parts)
    return out[["config", "series", "world_size", "samples_per_s", "samples_q1", "samples_q3", "samples_lo", "samples_hi", "ideal",
                "scaling_efficiency", "repetitions"]]


def sharded(runs: pd.DataFrame) -> pd.DataFrame:
    """Per configuration of a grid over stages: the median step and its q1-q3, peak bytes, the
    exposed reduction in the median step and the exposed all-gather seconds, with ``series`` (the
    stage; DDP's overlap and stage 3's prefetch and reshard where they vary), ``panel`` (what else
    varies besides bucket size: the optimizer, say) and ``position``, the series' place on the
    figure's x axis (stages in order). Bucket sizes are bars side by side within a series, so one
    bucket size draws a bar per stage, not a panel of single points. Empty unless two or more
    stages ran; a panel with one series left out (one bar compares nothing)."""
    df = ok(runs)
    if df.empty or "stage" not in df or df["stage"].nunique() < 2 or "peak_bytes" not in df:
        return df.iloc[0:0]
    # each stage's own knobs where they vary: DDP's overlap, stage 3's prefetch and reshard, the
    # sharded stages' shard group (hybrid sharding)
    knobs = {0: ["overlap"], 1: ["shard_group"], 2: ["shard_group"], 3: ["prefetch", "reshard", "shard_group"]}
    per_stage = {s: varying(df[df["stage"] == s], names) for s, names in knobs.items()}
    df["series"] = df.apply(lambda r: label(r, ["stage", *per_stage.get(int(r["stage"]), [])]), axis=1)
    inner = ["stage", "overlap", "prefetch", "reshard", "shard_group", "groups", "bucket_mb"]
    panels = context(df, [a for a in AXES if a not in inner])
    df["panel"] = df.apply(lambda r: label(r, panels), axis=1)
    df = df[df.groupby("panel")["series"].transform("nunique") > 1].copy()
    # The step's exposed_comm is the reductions' wait after backward compute at every stage (DDP's
    # all-reduce; commlab/sweep/wrap.py), so the median step's is the reductions' bar.
    df["exposed_reduction"] = df["exposed_comm_median"]
    one_per_cell(df, ["panel", "series", "bucket_mb"])
    rising = {"stage": True, "overlap": False, "prefetch": True, "reshard": False,  # overlap, reshard: on first
              "shard_group": True}
    order = [c for c in rising if c in df]
    df = df.sort_values([*panels, *order, "bucket_mb"], ascending=[True] * len(panels) + [rising[c] for c in order] + [True],
                        kind="stable")
    df["position"] = df.groupby("panel")["series"].transform(lambda s: pd.factorize(s)[0])
    return df[["config", "panel", "series", "position", "stage", "bucket_mb", "step_median", "step_q1", "step_q3",
               "peak_bytes", "exposed_allgather", "exposed_reduction"]]


def pick_timeline_config(runs: pd.DataFrame, buckets: pd.DataFrame) -> str | None:
    """The configuration whose timeline says most: overlapped, with the most buckets."""
    df = ok(runs)
    if df.empty or buckets.empty:
        return None
    counts = buckets.groupby("config")["bucket"].nunique().rename("n_buckets")
    df = df.join(counts, on="config").dropna(subset=["n_buckets"])
    if df.empty:
        return None
    df["overlap_first"] = ~df["overlap"].map(_truthy)
    return df.sort_values(["overlap_first", "n_buckets"], ascending=[True, False]).iloc[0]["config"]


def timeline(iterations: pd.DataFrame, buckets: pd.DataFrame, config: str, rank: int | None = None,
             iteration: int | None = None) -> tuple[pd.Series, pd.DataFrame]:
    """One iteration of one configuration on one rank: its phase row and its bucket rows.

    Without ``iteration``, the median step (:func:`stats.median_step`; the upper of the two
    middle ones when their number is even) on its slowest rank, or on ``rank``'s own steps, so
    the picture is the typical step the other figures report, not the warm-up-like first or an
    outlier. With ``iteration``: that one of the first repetition, on ``rank`` (default 0).
    """
    its = iterations[iterations["config"] == config]
    if iteration is None:
        steps = stats.slowest_ranks(its) if rank is None else its[its["rank"] == rank]
        if steps.empty:
            raise ValueError(f"no iterations for configuration {config!r}" + ("" if rank is None else f" on rank {rank}"))
        middle = steps.sort_values("step", kind="stable").iloc[len(steps) // 2]
        iteration, rank = int(middle["iteration"]), int(middle["rank"])
        repetition = middle.get("repetition")
    else:
        rank = 0 if rank is None else rank
        repetition = its["repetition"].min() if "repetition" in its and not its.empty else None
    if repetition is not None:
        its = its[its["repetition"] == repetition]
        buckets = buckets[buckets["repetition"] == repetition] if "repetition" in buckets else buckets
    row = its[(its["rank"] == rank) & (its["iteration"] == iteration)]
    if row.empty:
        raise ValueError(f"configuration {config!r} has no iteration {iteration} on rank {rank}")
    bks = buckets[(buckets["config"] == config) & (buckets["rank"] == rank) & (buckets["iteration"] == iteration)]
    return row.iloc[0], transfers(bks.sort_values("bucket"))


def transfers(bks: pd.DataFrame) -> pd.DataFrame:
    """Add ``started``: when a bucket's all-reduce can really have started moving data.

    A process group runs one collective at a time, in launch order (Gloo's one thread per
    group; NCCL's one stream per group; commlab's worker per group). A bucket launched while the
    group's previous all-reduce is still running waits inside the backend until that one is done:
    ``started = max(launched, done of the group's previous launch)``. Between ``launched`` and
    ``started`` it is queued, not transferring. With round-robin groups, bucket i goes to group
    i % groups (commlab.ddp).
    """
    if bks.empty:
        return bks.assign(started=pd.Series(dtype=float))
    groups = int(bks["groups"].iloc[0]) if "groups" in bks and pd.notna(bks["groups"].iloc[0]) else 1
    started = pd.Series(bks["launched"], index=bks.index, dtype=float)
    busy_until: dict[int, float] = {}
    for i, b in bks.sort_values("launched", kind="stable").iterrows():
        group = int(b["bucket"]) % max(1, groups)
        started[i] = max(b["launched"], busy_until.get(group, float("-inf")))
        busy_until[group] = max(busy_until.get(group, float("-inf")), b["done"])
    return bks.assign(started=started)


def first_repetition(df: pd.DataFrame) -> pd.DataFrame:
    """The rows of the first repetition present (a timeline or trace shows one run, not several)."""
    if "repetition" not in df or df.empty:
        return df
    return df[df["repetition"] == df["repetition"].min()]


def _hidden(df: pd.DataFrame, cell: list[str], settings: list[str] = SETTINGS) -> list[str]:
    """Settings that differ between configurations sharing a figure cell (they facet the series)."""
    crowded = df[df.duplicated(cell, keep=False)]
    return [c for c in settings if c in crowded and (crowded.groupby(cell)[c].nunique() > 1).any()]


def one_per_cell(df: pd.DataFrame, keys: list[str]) -> None:
    """Refuse to draw two configurations as one point (their differences would be hidden)."""
    dup = df[df.duplicated(keys, keep=False)]
    if not dup.empty:
        raise ValueError(f"two configurations in one figure cell ({', '.join(dup['config'].head(2))}): "
                         "they differ in a setting the figure does not show; redraw from separate results")


def _curves_only(df: pd.DataFrame, keys: list[str], x: str) -> pd.DataFrame:
    """Drop series with a single x value: one point is not a curve (e.g. after a grid was extended)."""
    return df[df.groupby(keys)[x].transform("nunique") > 1].copy()


def context(df: pd.DataFrame, columns: list[str]) -> list[str]:
    """Model, backend and world size always (a panel says what it shows), plus what else varies."""
    always = [c for c in ("model", "backend", "world_size") if c in columns]
    return always + [c for c in varying(df, columns) if c not in always]


def _truthy(v) -> bool:
    return v is True or str(v).lower() in ("true", "1")
