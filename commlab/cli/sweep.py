"""The `commlab sweep`, `commlab figures` and `commlab trace` commands.

\b
    commlab sweep --bucket-mb 5,25,100                 the README's first command
    commlab sweep sweeps/bucket_size.yaml              a paper figure's spec (options override it)
    commlab sweep sweeps/smoke.yaml --resume           continue a killed sweep
    commlab sweep --model gpt --tp 1,2 --world-size 2  tensor x data parallel layouts
    commlab sweep --model gpt --tp 1,2 --pp 1,2 --dp 1 tensor x pipeline layouts
    commlab figures results/reference                  redraw every figure from the CSVs
    commlab trace results/reference --config ID        one configuration as a Chrome trace
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import click
import yaml

from commlab.cli.renamed import add_old_spelling
from commlab.runs.config import DEFAULTS, LAUNCHERS, SCALINGS
from commlab.runs.grid import build_grid, merge
from commlab.cli.writable import check_writable

_LIST = "comma-separated list"


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("spec_file", required=False, type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--model", help=f"{_LIST}: mlp, transformer, gpt, resnet50, bert or package.module:factory [mlp]")
@click.option("--model-args", help="model sizes as key=value,... e.g. depth=2,width=64")
@click.option("--bucket-mb", help=f"{_LIST} of bucket caps in MiB (as torch's bucket_cap_mb), e.g. 5,25,100 [25]")
@click.option("--backend", help=f"{_LIST}: gloo, nccl [gloo]")
@click.option("--world-size", help=f"{_LIST} of process counts (the paper's GPU axis) [2]")
@click.option("--tp", help=f"{_LIST}: tensor-parallel sizes (commlab.tensor, --model gpt) [1]")
@click.option("--pp", help=f"{_LIST}: pipeline stages (--model mlp or gpt, over commlab DDP) [1]")
@click.option("--microbatches", help=f"{_LIST}: pipeline micro-batches per step, with --pp > 1 [2 x pp]")
@click.option("--schedule", help=f"{_LIST}: pipeline schedules of one stage per rank: gpipe, 1f1b, zb-h1 [1f1b]")
@click.option("--dp", help=f"{_LIST}: data-parallel sizes; the world size is then tp x pp x dp [world size / (tp x pp)]")
@click.option("--algorithm", help=f"{_LIST} of all-reduce algorithms (commlab.collectives) [native]")
@click.option("--overlap", type=click.Choice(["on", "off", "both"]), help="overlap comm with backward [both]")
@click.option("--accumulate", help=f"{_LIST}: micro-batches per step, all but one under no_sync [1]")
@click.option("--groups", help=f"{_LIST}: round-robin process groups [1]")
@click.option("--threads", help=f"{_LIST}: torch threads per rank, the same at every world size [1]")
@click.option("--stage", help=f"{_LIST}: 0 = commlab DDP, 1-3 = ShardedDataParallel's ZeRO stage [0]")
@click.option("--prefetch", help=f"{_LIST}: stage 3's all-gathers ahead of use [1]")
@click.option("--reshard", type=click.Choice(["on", "off", "both"]), help="stage 3: free gathered parameters after forward [on]")
@click.option("--shard-group", help=f"{_LIST}: stages 1-3, ranks per shard group, replicated across groups "
              "(hybrid sharding, HSDP); 0 = every data-parallel rank [0]")
@click.option("--optimizer", help=f"{_LIST}: sgd (plain, no state), adam [adam when --stage has 1-3, whose "
              "saving is the optimizer state; sgd for DDP alone, as DDP results before this option]")
@click.option("--scaling", type=click.Choice(SCALINGS), help="strong: split --global-batch; weak: --batch-per-rank [strong]")
@click.option("--global-batch", type=click.IntRange(min=1), help=f"samples per micro-batch over all ranks [{DEFAULTS['global_batch']}]")
@click.option("--batch-per-rank", type=click.IntRange(min=1), help="samples per micro-batch per rank (weak scaling)")
@click.option("--iters", type=click.IntRange(min=1), help=f"measured steps per configuration [{DEFAULTS['iters']}]")
@click.option("--warmup", type=click.IntRange(min=0), help=f"unmeasured steps first [{DEFAULTS['warmup']}]")
@click.option("--repeat", type=click.IntRange(min=1), help="run the grid N times, alternating forward and backward order; "
              "each configuration reports the median step over all of them and the spread of their medians [1]")
@click.option("--out", type=click.Path(file_okay=False), help="parent directory of results [results]")
@click.option("--name", help="results go to OUT/NAME [the spec file's name, else sweep-<time>]")
@click.option("--resume", is_flag=True, help="continue OUT/NAME (NAME: --name, else the spec file's name, else the "
              "latest run under OUT), skipping configurations already finished")
@click.option("--force", is_flag=True, help="with --resume: accept a grid or --repeat that differs from the run's")
@click.option("--launcher", type=click.Choice(LAUNCHERS), help="spawn local ranks, or one torchrun per configuration [local]")
@click.option("--timeout", type=click.FloatRange(min=0, min_open=True), help="seconds per configuration before it is ended [300]")
@click.option("--nnodes", type=click.IntRange(min=1), help="nodes per torchrun job (multi-node, see scripts/) [1]")
@click.option("--rdzv-endpoint", help="HOST:PORT of torchrun's rendezvous for --nnodes > 1")
@click.option("--figures/--no-figures", "draw", default=True, help="draw the figures at the end [on]")
def sweep(spec_file: Path | None, resume: bool, force: bool, draw: bool, **options) -> None:
    """Measure commlab's DDP (or ShardedDataParallel, --stage) over a grid: bucket size x backend x world size x ...

    Every combination of the list options is one configuration, run in a fresh process group;
    results (CSV), metadata and figures go to OUT/NAME. Options override SPEC_FILE (YAML with the
    same keys, e.g. sweeps/reference.yaml).
    """
    import commlab
    from commlab.runtime.interrupt import keep_partial
    from commlab.runtime.metadata import command_line, dirty_warning, environment, git_state
    from commlab.sweep import runner
    from commlab.runs import store
    from commlab.runs.grid import grid_change, grid_signature, grid_union

    if options.get("name") is not None and not options["name"].strip():
        raise click.BadParameter("an empty name: give a plain directory name inside --out, or leave --name out",
                                 param_hint="--name")
    spec = _read_spec(spec_file)
    try:
        plan = build_grid(merge(spec, options))
    except ValueError as err:
        raise click.UsageError(str(err)) from None
    check_writable(plan.out)
    try:
        runner.check_grid(plan)
    except ValueError as err:
        raise click.UsageError(str(err)) from None
    if plan.nnodes > 1 and not (plan.name or spec_file):
        raise click.UsageError("a multi-node sweep needs --name (or a spec file) so that every node agrees on it")
    # Multi-node: every node's driver runs the same grid in step (each starts its torchrun per
    # configuration); node 0 alone writes, into a directory all nodes see for --resume.
    node_rank = int(os.environ.get("SLURM_NODEID", os.environ.get("NODE_RANK", "0"))) if plan.nnodes > 1 else 0
    run_dir = _run_dir(plan.out, plan.name or (spec_file.stem if spec_file else None), resume, node_rank == 0)
    echo = lambda line: click.echo(line, err=True)  # noqa: E731  (results go to files, chatter to stderr)
    echo(f"commlab sweep: {len(plan.configs)} configuration(s) -> {run_dir}")
    if node_rank != 0:
        runner.run(plan, run_dir, resume=resume, echo=echo, write=False)
        return
    meta = store.read_metadata(run_dir)
    change = grid_change(meta.get("grid"), grid_signature(plan)) if resume else None
    if change and not force:
        raise click.UsageError(f"--resume {run_dir}: {change}. Add --force to add it to that run, "
                               "or give another --name")
    run_dir.mkdir(parents=True, exist_ok=True)
    meta = meta or {"environment": environment()}
    meta["grid"] = grid_union(meta.get("grid"), grid_signature(plan))
    # The load average says how far to trust the timings (other work shares the CPUs); the git
    # state is this session's (a resumed run may continue on other code).
    session = {"command": command_line(click.get_current_context()), "start": _now(), "end": None,
               "load_average_start": os.getloadavg(), "git": git_state(Path(commlab.__file__).resolve().parent)}
    if warning := dirty_warning(session):
        echo(warning)
    meta.setdefault("sessions", []).append(session)
    store.write_metadata(run_dir, meta)
    begin = time.monotonic()

    def interrupted() -> str:  # every finished configuration is already on disk (store, atomic)
        session["end"], session["interrupted"] = _now(), True
        store.write_metadata(run_dir, meta)
        return f"{run_dir} (the finished configurations)"

    with keep_partial(interrupted, resume="rerun with --resume to continue"):
        runner.run(plan, run_dir, resume=resume, echo=echo)
    records = store.load_records(run_dir)
    session["end"], session["load_average_end"] = _now(), os.getloadavg()
    meta["hosts"] = sorted({h for r in records for h in r.get("hosts", [])})
    meta["devices"] = sorted({d for r in records for d in r.get("devices", [])})
    store.write_metadata(run_dir, meta)

    if draw:
        from commlab.sweep.figures import draw_all

        written = draw_all(run_dir)
        pngs = [p.name for p in written if p.suffix == ".png"]
        echo(f"figures in {run_dir / 'figures'}: {', '.join(pngs)} (+ PDF)" if pngs else "figures: none (no successful configuration)")
    from commlab.runs.stats import fastest, superlinear
    from commlab.runs.store import read_tables

    table = read_tables(run_dir)[2]
    for line in [*fastest(table), *superlinear(table)]:
        echo(line)
    failed = [r["config"]["config"] for r in records if r["status"] != "ok"]
    echo(f"done in {time.monotonic() - begin:.0f} s: {len(records) - len(failed)} ok, {len(failed)} failed -> {run_dir}")
    if failed:
        raise click.ClickException(f"{len(failed)} configuration(s) failed (status and error in {run_dir / 'runs.csv'})")


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("run_dir", type=click.Path(exists=True, file_okay=False, path_type=Path))
def figures(run_dir: Path) -> None:
    """Redraw every figure of a sweep's results directory from its CSVs (PNG and PDF)."""
    from commlab.sweep.figures import draw_all

    try:
        written = draw_all(run_dir)
    except FileNotFoundError as err:
        raise click.UsageError(str(err)) from None
    for path in written:
        click.echo(str(path))
    if not written:
        click.echo("no successful configuration to draw", err=True)


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("run_dir", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--config", "config_id", help="configuration id (runs.csv `config`) [one that communicates: the timeline figure's]")
@click.option("-o", "--output", type=click.Path(dir_okay=False, path_type=Path), help="[RUN_DIR/trace-<config>[-torch-profiler].json]")
@click.option("--torch-profiler", is_flag=True, help="rerun the configuration under torch.profiler (a real trace) instead "
              "of laying its measured times end to end (the light default)")
@click.option("--steps", type=click.IntRange(min=1), default=3, show_default=True, help="with --torch-profiler: steps recorded")
@click.option("--timeout", type=click.FloatRange(min=0, min_open=True), default=300.0, show_default=True,
              help="with --torch-profiler: seconds before the run is ended")
def trace(run_dir: Path, config_id: str | None, output: Path | None, torch_profiler: bool, steps: int,
          timeout: float) -> None:
    """Write one configuration as Chrome trace JSON (Perfetto, chrome://tracing).

    By default the trace is reconstructed from the measured timings (no new run). With --torch-profiler
    the configuration runs again under torch.profiler on every rank, and the ranks' traces are
    merged on one clock: torch operators, commlab's phases and the backend's collectives.
    """
    from commlab.runs.store import read_tables
    from commlab.sweep.trace import pick_config, write_trace

    try:
        iterations, buckets, runs = read_tables(run_dir)
        if not torch_profiler:
            click.echo(str(write_trace(iterations, buckets, runs, config_id, output, run_dir)))
            return
        config_id = pick_config(runs, config_id, run_dir, buckets)
    except (FileNotFoundError, ValueError) as err:
        raise click.UsageError(str(err)) from None
    import json

    import commlab
    from commlab._atomic import write_text
    from commlab.runtime.orphans import sigterm_as_interrupt
    from commlab.sweep import torch_trace
    from commlab.runs.config import Config
    from commlab.runs.store import load_records

    record = next(r for r in load_records(run_dir) if r["config"]["config"] == config_id)
    cfg = Config.from_columns(record["config"])
    click.echo(f"recording {steps} step(s) of {config_id} under torch.profiler on {cfg.world_size} rank(s) ...", err=True)
    with sigterm_as_interrupt():
        per_rank = commlab.launch(torch_trace.trace_rank, cfg, steps, world_size=cfg.world_size, backend=cfg.backend, timeout=timeout)
    path = output or run_dir / f"trace-{config_id}-torch-profiler.json"
    write_text(path, json.dumps(torch_trace.merge(per_rank, config_id)))
    click.echo(str(path))


add_old_spelling(trace, "torch_profiler", "--profile")


def _read_spec(path: Path | None) -> dict:
    if path is None:
        return {}
    try:
        spec = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        raise click.BadParameter(f"{path}: not valid YAML ({err})", param_hint="SPEC_FILE") from None
    if not isinstance(spec, dict):
        raise click.BadParameter(f"{path}: expected a mapping of option: value", param_hint="SPEC_FILE")
    return spec


def _run_dir(out: str, name: str | None, resume: bool, writer: bool = True) -> Path:
    """OUT/NAME; with --resume and no name, the most recent sweep under OUT."""
    out_dir = Path(out)
    if name is not None and (not name.strip() or name in (".", "..") or Path(name).name != name or "\\" in name):
        raise click.BadParameter(f"{name!r} must be a plain directory name inside --out (no / or ..)", param_hint="--name")
    runs = sorted((p for p in out_dir.glob("*/configs") if p.is_dir()), key=lambda p: p.stat().st_mtime)
    if name is None and resume:
        if not runs:
            raise click.UsageError(f"--resume: no sweep to resume under {out_dir}/ (give --name)")
        return runs[-1].parent
    run_dir = out_dir / (name or time.strftime("sweep-%Y%m%d-%H%M%S"))
    if resume and not ((run_dir / "configs").is_dir() or (run_dir / "metadata.json").is_file()):
        # A run stopped before its first configuration finished has metadata and no configs/ yet.
        there = ", ".join(sorted({p.parent.name for p in out_dir.glob("*/metadata.json")} | {p.parent.name for p in runs}))
        there = there or "none"
        raise click.UsageError(f"--resume: no sweep named {name!r} under {out_dir}/ (runs there: {there}); "
                               "leave out --resume to start it")
    if writer and not resume and any((run_dir / "configs").glob("*.json")):
        raise click.UsageError(f"{run_dir} already holds results: add --resume to continue it, or pick another --name")
    return run_dir


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S%z")

