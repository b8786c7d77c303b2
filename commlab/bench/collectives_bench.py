"""`commlab bench collectives`: the nccl-tests of commlab, for every all-reduce algorithm.

    commlab bench collectives                               # 1K..16M, world 2, gloo, all algorithms
    commlab bench collectives -b 4M -e 64M -f 2 --world-size 2,4 --algorithm ring,native
    commlab bench collectives -b 8 -e 64K --world-size 4 --algorithm tree,ring -n 200
    commlab bench collectives --backend nccl --world-size 8 -b 1M -e 1G   # one GPU per rank
    commlab bench collectives -b 4M -e 64M -f 2 -n 10 --algorithm ring,native --world-size 2,4 --repeat 5

Per world size it prints one table, a row as each size completes (size, count, type, redop,
root, algorithm, then time, algbw, busbw, #wrong and the slowest rank's time for out-of-place and
for in-place), the average bus bandwidth and the fitted alpha-beta model of each algorithm, then
writes under ``--out``:
``collectives.csv`` (tidy, one row per size x algorithm x world size, with the run's metadata),
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

from commlab.bench.alpha_beta import format_size, parse_size, size_sweep

DTYPES = {"float32": 4, "float64": 8, "float16": 2, "bfloat16": 2, "int32": 4, "int64": 8}
OPS = ("sum", "avg", "max", "min")


class _Size(click.ParamType):
    name = "SIZE"

    def convert(self, value, param, ctx):
        try:
            return parse_size(value)
        except ValueError as e:
            self.fail(str(e), param, ctx)


def _int_list(value: str, name: str, minimum: int) -> list[int]:
    try:
        items = [int(v) for v in value.split(",") if v.strip()]
    except ValueError:
        raise click.BadParameter(f"expected comma-separated integers, got {value!r}", param_hint=name) from None
    if not items or min(items) < minimum:
        raise click.BadParameter(f"expected integers >= {minimum}, got {value!r}", param_hint=name)
    return list(dict.fromkeys(items))


def _algorithms(value: str) -> list[str]:
    from commlab.collectives import algorithm_names

    known = algorithm_names()
    if value.strip() == "all":
        return known
    chosen = list(dict.fromkeys(v.strip() for v in value.split(",") if v.strip()))
    unknown = [a for a in chosen if a not in known]
    if not chosen or unknown:
        raise click.BadParameter(
            f"unknown algorithm(s) {', '.join(unknown) or repr(value)}: choose from {', '.join(known)} or all",
            param_hint="--algorithm",
        )
    return chosen


@click.command("collectives")
@click.option("-b", "--min-bytes", type=_Size(), default="1K", show_default=True, help="Smallest message (1K, 64M, ...).")
@click.option("-e", "--max-bytes", type=_Size(), default="16M", show_default=True, help="Largest message.")
@click.option("-f", "--step-factor", type=click.IntRange(min=2), default=4, show_default=True, help="Size multiplier.")
@click.option("-n", "--iters", type=click.IntRange(min=1), default=10, show_default=True, help="Timed iterations per size.")
@click.option("-w", "--warmup", type=click.IntRange(min=0), default=2, show_default=True, help="Untimed iterations first.")
@click.option("--algorithm", "algorithm", default="all", show_default=True, help="Comma list of algorithms, or all.")
@click.option("--world-size", "world_size", default="2", show_default=True, help="Comma list of world sizes.")
@click.option("--backend", type=click.Choice(["auto", "gloo", "nccl"]), default="gloo", show_default=True)
@click.option("--dtype", type=click.Choice(list(DTYPES)), default="float32", show_default=True)
@click.option("--op", type=click.Choice(OPS), default="sum", show_default=True)
@click.option("--check/--no-check", default=True, show_default=True, help="Count wrong elements (#wrong).")
@click.option("--out", "out_dir", type=click.Path(file_okay=False), default="results/collectives", show_default=True)
@click.option("--timeout", type=click.FloatRange(min=1), default=900.0, show_default=True, help="Seconds per world size.")
@click.option("--repeat", type=click.IntRange(min=1), default=1, show_default=True,
              help="Run the whole sweep N times; with native among the algorithms, print each run's ratios to it.")
def bench_collectives(min_bytes, max_bytes, step_factor, iters, warmup, algorithm, world_size, backend, dtype, op, check, out_dir, timeout, repeat):
    """nccl-tests-style all-reduce benchmark of every algorithm (interleaved, fair comparison)."""
    algorithms = _algorithms(algorithm)
    worlds = _int_list(world_size, "--world-size", 1)
    try:
        sizes = size_sweep(min_bytes, max_bytes, step_factor, DTYPES[dtype])
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="-b/-e") from None
    import pandas as pd
    import torch

    import commlab
    from commlab.bench.collectives_ratio import ratio_lines
    from commlab.bench.collectives_report import combine_ranks, fit_line, fit_table, footer_lines, header_lines, write_outputs
    from commlab.bench.collectives_run import run_rank
    from commlab.runtime import resolve_backend

    try:
        backends = {w: resolve_backend(backend, w) for w in worlds}
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--backend/--world-size") from None
    stamp = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    frames, fits, loads = [], [], {}
    for run, world in [(run, world) for run in range(repeat) for world in worlds]:
        loads[(run, world)] = os.getloadavg()[0]
        meta = {
            "backend": backends[world], "dtype": dtype, "op": op, "iters": iters, "warmup": warmup,
            "timestamp": stamp, "host": platform.node(), "torch": torch.__version__, "commlab": commlab.__version__,
            "run": run, "load_avg_1min": loads[(run, world)],
        }
        # stream: rank 0 prints each size's rows as soon as that size is done (nccl-tests does).
        config = {"sizes": sizes, "algorithms": algorithms, "dtype": dtype, "op": op,
                  "iters": iters, "warmup": warmup, "check": check, "stream": True}  # fmt: skip
        click.echo(f"# all-reduce: world size {world}, backend {meta['backend']}, {dtype} {op}, "
                   f"{format_size(sizes[0])}..{format_size(sizes[-1])}, {iters} iters ({warmup} warm-up)"
                   + (f", run {run + 1} of {repeat}, load {loads[(run, world)]:.2f}" if repeat > 1 else ""))  # fmt: skip
        for line in header_lines():
            click.echo(line)
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
    results = pd.concat(frames, ignore_index=True)
    paths = write_outputs(results, pd.concat(fits, ignore_index=True), out_dir)
    _write_metadata(out_dir, stamp)
    for line in ratio_lines(results, "native", loads):
        click.echo(line)
    wrong = int(results.loc[results["wrong"] > 0, "wrong"].sum())
    click.echo(f"# wrote {paths['results']}, {paths['alpha_beta']}, {paths['figure']}")
    if wrong:
        raise click.ClickException(f"{wrong} wrong elements in total: see the #wrong column")


def _write_metadata(out_dir: str, stamp: str) -> None:
    """metadata.json next to the CSVs: the full command, versions, machine, threads, git state."""
    import json

    from commlab._atomic import write_text
    from commlab.runtime.metadata import command_line, environment

    meta = {"command": command_line(click.get_current_context()), "start": stamp, "environment": environment()}
    write_text(os.path.join(out_dir, "metadata.json"), json.dumps(meta, indent=2, default=str) + "\n")
