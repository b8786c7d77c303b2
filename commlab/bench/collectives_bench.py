"""`commlab bench collectives`: the nccl-tests of commlab, for every collective and algorithm.

    commlab bench collectives                               # 1K..16M, world 2, gloo, all algorithms
    commlab bench collectives -b 4M -e 64M -f 2 --world-size 2,4 --algorithm ring,native
    commlab bench collectives -b 8 -e 64K --world-size 4 --algorithm tree,ring -n 200
    commlab bench collectives --backend nccl --world-size 8 -b 1M -e 1G   # one GPU per rank
    commlab bench collectives -b 4M -e 64M -f 2 -n 10 --algorithm ring,native --world-size 2,4 --repeat 5
    commlab bench collectives --collective all_reduce,reduce_scatter,all_gather,broadcast

Collectives are plug-ins (:mod:`commlab.bench.collectives_plugins`, all-reduce by default).
Per world size and collective it prints one table, a row as each size completes (size, count, type, redop,
root, algorithm, then time, algbw, busbw, #wrong and the slowest rank's time for out-of-place and
for in-place), the average bus bandwidth and the fitted alpha-beta model of each algorithm, then
writes under ``--out``:
``collectives.csv`` (tidy, one row per collective x size x algorithm x placement x world size,
with the run's metadata),
``alpha_beta.csv`` and ``busbw.png``. Algorithms of one size run interleaved (see
:mod:`commlab.bench.collectives_run`), so their ratios are fair on a shared machine. With
``native`` among the algorithms it ends with each other algorithm's time ratio to native per size
and their geomean (:mod:`commlab.bench.collectives_ratio`); ``--repeat N`` runs the whole sweep N
times (world sizes alternating) and shows each run's ratios, their median and range.
"""

from __future__ import annotations

import datetime
import os
import platform
import sys

import click
import pandas as pd
import torch

import commlab
from commlab.runs.traffic import format_size
from commlab.runtime.interrupt import keep_partial
from commlab.bench.collectives_plugins import Collective, collective_names, get_collective
from commlab.bench.collectives_ratio import ratio_lines
from commlab.bench.collectives_report import combine_ranks, fit_line, fit_table, footer_lines, write_outputs
from commlab.bench.collectives_run import run_rank


def run(*, sizes: list[int], collectives: list[tuple[Collective, list[str]]], worlds: list[int], backends: dict[int, str], dtype: str, op: str,
        iters: int, warmup: int, check: bool, out_dir: str, timeout: float, repeat: int) -> None:
    """Run the benchmark for each world size (``repeat`` times) and print and write its results.

    ``collectives``: each plug-in with the algorithms of it to run (:func:`choose`). The options
    were checked by :mod:`commlab.cli.bench`, which declares them.
    """
    stamp = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    frames, fits, loads = [], [], {}
    partial = os.path.join(out_dir, ".collectives.partial.csv")  # rank 0's rows of the current launch
    current: dict = {}  # the launch in progress: its metadata columns

    def save_partial() -> str | None:
        rows = list(frames)
        if current and os.path.exists(partial):
            rows.append(pd.read_csv(partial).assign(**{k: v for k, v in current.items() if k not in ("dtype", "op")}))
        if not rows:
            return None
        results = pd.concat(rows, ignore_index=True)
        paths = write_outputs(results, fit_table(results), out_dir)
        _write_metadata(out_dir, stamp)
        return f"{paths['results']} ({len(results)} rows)"

    try:
        with keep_partial(save_partial):
            for run, world in [(run, world) for run in range(repeat) for world in worlds]:
                loads[(run, world)] = os.getloadavg()[0]
                current = meta = {
                    "backend": backends[world], "dtype": dtype, "op": op, "iters": iters, "warmup": warmup,
                    "timestamp": stamp, "host": platform.node(), "torch": torch.__version__,
                    "commlab": commlab.__version__, "run": run, "load_avg_1min": loads[(run, world)],
                }
                # stream: rank 0 prints each size's rows as soon as that size is done (nccl-tests does).
                runnable, skipped = for_world(collectives, world)
                for line in skipped:
                    click.echo(line)
                config = {"sizes": sizes, "collectives": runnable, "dtype": dtype, "op": op, "iters": iters,
                          "warmup": warmup, "check": check, "stream": True, "partial": partial}  # fmt: skip
                names = ", ".join(c.name for c, _ in collectives)
                click.echo(f"# {names}: world size {world}, backend {meta['backend']}, {dtype} {op}, "
                           f"{format_size(sizes[0])}..{format_size(sizes[-1])}, {iters} iters ({warmup} warm-up)"
                           + (f", run {run + 1} of {repeat}, load {loads[(run, world)]:.2f}" if repeat > 1 else ""))  # fmt: skip
                sys.stdout.flush()  # before the ranks write their rows to the same stdout
                per_rank = commlab.launch(run_rank, config, world_size=world, backend=meta["backend"], timeout=timeout)
                df = combine_ranks(per_rank, meta)
                fit = fit_table(df)
                for line in footer_lines(df):
                    click.echo(line)
                click.echo("# alpha-beta fit, t = alpha + bytes / beta:")
                for row in fit.itertuples(index=False):
                    click.echo(fit_line(row))
                click.echo("")
                frames.append(df)
                fits.append(fit.assign(run=run) if repeat > 1 else fit)
                current = {}
    finally:
        if os.path.exists(partial):
            os.remove(partial)
    results = pd.concat(frames, ignore_index=True)
    paths = write_outputs(results, pd.concat(fits, ignore_index=True), out_dir)
    _write_metadata(out_dir, stamp)
    for line in ratio_lines(results, "native", loads):
        click.echo(line)
    wrong = int(results.loc[results["wrong"] > 0, "wrong"].sum())
    click.echo(f"# wrote {paths['results']}, {paths['alpha_beta']}, {paths['figure']}")
    if wrong:
        raise click.ClickException(f"{wrong} wrong elements in total: see the #wrong column")


def choose(collectives: list[str], algorithms: str) -> list[tuple[Collective, list[str]]]:
    """Each named collective with the chosen algorithms it has ("all": every one of its own).

    ValueError for an unknown collective, an algorithm none of them has, or a collective left
    with none of the chosen algorithms.
    """
    plugins = []
    for name in collectives:
        if name not in collective_names():
            raise ValueError(f"unknown collective {name!r}: choose from {', '.join(collective_names())}")
        plugins.append(get_collective(name))
    if algorithms.strip() == "all":
        return [(c, c.algorithms()) for c in plugins]
    chosen = list(dict.fromkeys(a.strip() for a in algorithms.split(",") if a.strip()))
    known = list(dict.fromkeys(a for c in plugins for a in c.algorithms()))
    unknown = [a for a in chosen if a not in known]
    if not chosen or unknown:
        raise ValueError(f"unknown algorithm(s) {', '.join(unknown) or repr(algorithms)}: "
                         f"choose from {', '.join(known)} or all")
    picked = [(c, [a for a in chosen if a in c.algorithms()]) for c in plugins]
    if empty := [c.name for c, algs in picked if not algs]:
        raise ValueError(f"{', '.join(empty)} has none of {', '.join(chosen)}: "
                         + "; ".join(f"{c.name} has {', '.join(c.algorithms())}" for c in plugins))
    return picked


def for_world(collectives: list[tuple[Collective, list[str]]], world: int) -> tuple[list, list[str]]:
    """The (collective, algorithms) that run on ``world`` ranks, and a line for each algorithm left
    out (halving-doubling's reduce-scatter on 3 ranks); a collective left with none is dropped."""
    kept, skipped = [], []
    for c, algorithms in collectives:
        runs = []
        for a in algorithms:
            try:
                c.check(a, world)
                runs.append(a)
            except ValueError as e:
                skipped.append(f"# {c.name} {a} left out at world size {world}: {e}")
        if runs:
            kept.append((c, runs))
    return kept, skipped


def _write_metadata(out_dir: str, stamp: str) -> None:
    """metadata.json next to the CSVs: the full command, versions, machine, threads, git state."""
    import json

    from commlab._atomic import write_text
    from commlab.runtime.metadata import command_line, environment

    meta = {"command": command_line(click.get_current_context()), "start": stamp, "environment": environment()}
    write_text(os.path.join(out_dir, "metadata.json"), json.dumps(meta, indent=2, default=str) + "\n")
