"""`commlab pipeline`: print a schedule, simulate it, benchmark the executor against torch.

    commlab pipeline show --schedule 1f1b --ranks 4 --microbatches 8       the step x rank grid
    commlab pipeline simulate --ranks 4 --microbatches 8 --backward 2      bubble of every schedule
    commlab pipeline bench --microbatches 2,4,8                            commlab vs torch, CSV + figures
    commlab pipeline plan --ranks 2 --budget-mb 16                         fastest plan under a memory budget
    commlab pipeline plan --validate ...                                   ... and its pick measured against the grid
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import click

from commlab.pipeline.schedules import REGISTRY

SCHEDULE_NAMES = tuple(REGISTRY)  # the registry is the one list of schedules
BALANCE_MODES = ("uniform", "time", "size")


def _ints(text: str, option: str) -> list[int]:
    try:
        values = [int(v) for v in str(text).split(",") if v.strip()]
    except ValueError:
        raise click.BadParameter(f"expected comma-separated integers, got {text!r}", param_hint=option) from None
    if not values or min(values) < 1:
        raise click.BadParameter(f"expected positive integers, got {text!r}", param_hint=option)
    return values


def _names(text: str, allowed: tuple[str, ...], option: str) -> list[str]:
    names = [v.strip() for v in text.split(",") if v.strip()]
    bad = [n for n in names if n not in allowed]
    if bad or not names:
        raise click.BadParameter(f"{', '.join(bad) or text!r}: choose from {', '.join(allowed)}", param_hint=option)
    return names


def _schedule_names() -> tuple[str, ...]:
    return tuple(REGISTRY)


def _virtual(schedule: str, virtual: int) -> int:
    """Stages per rank for ``schedule``: its own if the registry fixes one, else ``--virtual``."""
    allowed = REGISTRY[schedule].virtual
    return virtual if allowed is None else allowed[0]


def _actions(schedule: str, ranks: int, microbatches: int, virtual: int):
    from commlab.pipeline import build, validate

    try:
        actions = build(schedule, ranks, microbatches, _virtual(schedule, virtual))
        validate(actions)
    except ValueError as err:
        raise click.UsageError(str(err)) from None
    return actions


@click.group("pipeline")
def pipeline() -> None:
    """Pipeline schedules: show, simulate, benchmark."""


@pipeline.command()
@click.option("--schedule", default="1f1b", show_default=True, type=click.Choice(SCHEDULE_NAMES))
@click.option("--csv", "csv_path", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="show a schedule read from torch.distributed.pipelining's compute-only CSV instead")
@click.option("--ranks", "-p", default=4, show_default=True, type=click.IntRange(min=1))
@click.option("--microbatches", "-m", default=8, show_default=True, type=click.IntRange(min=1))
@click.option("--virtual", "-v", default=2, show_default=True, type=click.IntRange(min=1), help="stages per rank (interleaved; zb-v: always 2)")
@click.option("--actions", "as_actions", is_flag=True, help="print each rank's action list instead of the grid")
@click.option("--backward", type=click.IntRange(min=1), help="ticks per backward (I and W: half each) [1, or 2 for I/W schedules]")
def show(schedule: str, csv_path: Path | None, ranks: int, microbatches: int, virtual: int, as_actions: bool, backward: int | None) -> None:
    """Print a schedule's step x rank grid (unit times for F, B, I and W; '.' is idle)."""
    from commlab.pipeline import format_actions, from_csv, grid, validate

    if csv_path is not None:
        try:
            actions = from_csv(csv_path.read_text())
            validate(actions)
        except ValueError as err:
            raise click.UsageError(str(err)) from None
    else:
        actions = _actions(schedule, ranks, microbatches, virtual)
    if as_actions:
        for r, line in enumerate(format_actions(actions)):
            click.echo(f"rank {r}: {line}")
    else:
        try:
            click.echo(grid(actions, backward))
        except ValueError as err:
            raise click.BadParameter(str(err), param_hint="--backward") from None


@pipeline.command()
@click.option("--schedules", default=",".join(SCHEDULE_NAMES), show_default=True)
@click.option("--ranks", "-p", default=4, show_default=True, type=click.IntRange(min=1))
@click.option("--microbatches", "-m", default="8", show_default=True, help="comma-separated")
@click.option("--virtual", "-v", default=2, show_default=True, type=click.IntRange(min=1))
@click.option("--forward", default=1.0, show_default=True, type=click.FloatRange(min=0), help="a stage's forward time")
@click.option("--backward", default=2.0, show_default=True, type=click.FloatRange(min=0), help="a stage's backward time")
@click.option("--comm", default=0.0, show_default=True, type=click.FloatRange(min=0), help="time per cross-rank message")
@click.option("--figure", type=click.Path(dir_okay=False, path_type=Path), help="also save the Gantt charts here (.png)")
def simulate(schedules, ranks, microbatches, virtual, forward, backward, comm, figure) -> None:
    """Step time, bubble and activations in flight of schedules with uniform stage times.

    Interleaved stages each do 1/v of a rank's work, so all schedules compare on the same model.
    """
    from commlab.pipeline import bubble_formula, simulate as run

    panels = []
    click.echo(f"{'schedule':<12} {'m':>4} {'step':>9} {'bubble':>8} {'formula':>8}  peak in flight per stage")
    for m in _ints(microbatches, "--microbatches"):
        for name in _names(schedules, _schedule_names(), "--schedules"):
            v = _virtual(name, virtual)
            sim = run(_actions(name, ranks, m, v), forward / v, backward / v, comm)
            # The closed form is GPipe's / 1F1B's / interleaved's; a split backward has none here.
            formula = f"{bubble_formula(ranks, m, v):8.3f}" if "I" not in REGISTRY[name].kinds else f"{'-':>8}"
            click.echo(f"{name:<12} {m:>4} {sim.step_time:>9.3f} {sim.bubble:>8.3f} {formula}  {list(sim.peak_in_flight)}")
            panels.append((f"{name}, p={ranks}, m={m}" + (f", v={v}" if v > 1 else ""), sim.timeline))
    if figure:
        from commlab.pipeline.render import gantt_figure

        gantt_figure(panels, ranks, str(figure))
        click.echo(f"wrote {figure}")


@pipeline.command()
@click.option("--schedules", default=",".join(SCHEDULE_NAMES), show_default=True)
@click.option("--microbatches", "-m", default="2,4,8", show_default=True, help="comma-separated")
@click.option("--balance", "balance_modes", default="time", show_default=True, help="uniform,time,size")
@click.option("--checkpoint", "checkpoints", default="never", show_default=True, help="never,except_last,always")
@click.option("--world-size", default=2, show_default=True, type=click.IntRange(min=2))
@click.option("--backend", default="gloo", show_default=True, type=click.Choice(["auto", "gloo", "nccl"]))
@click.option("--virtual", "-v", default=2, show_default=True, type=click.IntRange(min=1), help="stages per rank (interleaved; zb-v: always 2)")
@click.option("--depth", default=8, show_default=True, type=click.IntRange(min=1), help="MLP blocks")
@click.option("--width", default=1024, show_default=True, type=click.IntRange(min=1), help="MLP width")
@click.option("--batch", default=64, show_default=True, type=click.IntRange(min=1), help="mini-batch size")
@click.option("--iters", default=10, show_default=True, type=click.IntRange(min=1), help="timed steps each")
@click.option("--warmup", default=3, show_default=True, type=click.IntRange(min=0), help="untimed steps each")
@click.option("--calibrate", default=3, show_default=True, type=click.IntRange(min=1), help="commlab steps before the timed ones that calibrate the prediction")
@click.option("--out", default="results", show_default=True, type=click.Path(file_okay=False, path_type=Path))
@click.option("--name", help="results sub-directory [pipeline-<time>]")
@click.option("--timeout", default=600.0, show_default=True, type=click.FloatRange(min=0, min_open=True), help="seconds")
@click.option("--no-figures", is_flag=True)
def bench(schedules, microbatches, balance_modes, checkpoints, world_size, backend, virtual, depth, width, batch,
          iters, warmup, calibrate, out, name, timeout, no_figures) -> None:  # fmt: skip
    """commlab's pipeline vs torch.distributed.pipelining, alternating; bubble, memory, figures."""
    import commlab
    from commlab.pipeline.bench import measure_rank, stage_rows, summarise, timeline_rows
    from commlab.pipeline.executor import CHECKPOINT_MODES, check_plan
    from commlab.runtime import resolve_backend

    try:
        backend = resolve_backend(backend, world_size)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--backend") from None
    common = dict(depth=depth, width=width, batch=batch, iters=iters, warmup=warmup, calibrate=calibrate, timeout=timeout)
    configs = []
    balances: dict[tuple[str, int], list[int]] = {}  # one balance per mode and stage count, shared by all schedules
    for schedule in _names(schedules, _schedule_names(), "--schedules"):
        v = _virtual(schedule, virtual)
        for mode in _names(balance_modes, BALANCE_MODES, "--balance"):
            if (mode, world_size * v) not in balances:
                # Profiled at the micro-batch size the pipeline runs (the smallest asked for).
                mb = max(1, batch // max(_ints(microbatches, "--microbatches")))
                balances[(mode, world_size * v)] = _balance(mode, depth, width, mb, world_size * v, world_size)
            balance = balances[(mode, world_size * v)]
            for m in _ints(microbatches, "--microbatches"):
                if m > batch:
                    raise click.BadParameter(f"{m} micro-batches need a batch of at least {m}, got {batch}", param_hint="--microbatches")
                for ck in _names(checkpoints, CHECKPOINT_MODES, "--checkpoint"):
                    try:
                        check_plan(schedule, world_size * v, world_size, m, ck,
                                   REGISTRY[schedule].placement(world_size, world_size * v))
                    except ValueError as err:
                        raise click.UsageError(f"{schedule}, m={m}: {err}") from None
                    cid = f"{schedule}-m{m}-{mode}-{ck}"
                    configs.append(dict(config=cid, schedule=schedule, microbatches=m, balance_mode=mode,
                                        balance=balance, checkpoint=ck, virtual=v))  # fmt: skip
    run_dir = out / (name or time.strftime("pipeline-%Y%m%d-%H%M%S"))
    click.echo(f"{len(configs)} configurations, world {world_size}, {backend}, MLP {depth} x {width}, batch {batch}; "
               f"{iters} timed steps each after {warmup}, commlab and torch alternating -> {run_dir}")  # fmt: skip
    per_rank = commlab.launch(measure_rank, configs, common, world_size=world_size, backend=backend, timeout=timeout)
    summary, stages, timeline = [], [], []
    for k, cfg in enumerate(configs):
        results = [r[k] for r in per_rank]
        summary.append(summarise(cfg, results, world_size, batch, backend))
        stages += stage_rows(cfg, results)
        timeline += timeline_rows(cfg, results, world_size)
    _write(run_dir, summary, stages, timeline, common, backend, world_size)
    _print(summary, stages)
    if not no_figures:
        from commlab.pipeline.figures import draw_all

        for path in draw_all(run_dir):
            click.echo(f"wrote {path}")


def _balance(mode: str, depth: int, width: int, batch: int, stages: int, world_size: int) -> list[int]:
    """The balance decided once, in the parent, so every rank splits the model the same way."""
    import torch

    from commlab.models import mlp
    from commlab.pipeline import balance_by_size, balance_by_time, partition

    torch.manual_seed(0)
    model = mlp(depth, width)
    if stages > len(model):
        raise click.BadParameter(f"{stages} stages but the MLP has only {len(model)} layers", param_hint="--depth")
    if mode == "uniform":
        return partition([1.0] * len(model), stages)
    sample = torch.randn(batch, width)
    if mode != "time":
        return balance_by_size(model, sample, stages)
    # Profile with a rank's threads (commlab.launch gives each cores // world), not the parent's.
    threads = torch.get_num_threads()
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    try:
        return balance_by_time(model, sample, stages, repeat=5)
    finally:
        torch.set_num_threads(threads)


def _write(run_dir: Path, summary, stages, timeline, common, backend, world_size) -> None:
    import pandas as pd

    from commlab._atomic import write_text
    from commlab.runtime.metadata import command_line, environment

    for file, rows in (("summary.csv", summary), ("stages.csv", stages), ("timeline.csv", timeline)):
        write_text(run_dir / file, pd.DataFrame(rows).to_csv(index=False))
    meta = {"command": command_line(click.get_current_context()), **common, "backend": backend, "world_size": world_size, "environment": environment()}
    write_text(run_dir / "metadata.json", json.dumps(meta, indent=2, default=str))


def _print(summary, stages) -> None:
    click.echo(f"{'config':<30} {'commlab ms':>10} {'pred ms':>8} {'torch ms':>9} {'ratio':>6} {'paired':>6} {'samples/s':>9} "
               f"{'bubble':>6} {'wait':>6} {'ready':>6} {'sim':>6} {'replay':>6} {'formula':>7} {'msg ms':>6} {'stage0 MiB':>10}")  # fmt: skip
    for row in summary:
        first = [s["saved_bytes"] for s in stages if s["config"] == row["config"] and s["stage"] == 0][0]
        torch_ms = f"{row['torch_s'] * 1e3:9.2f}" if "torch_s" in row else f"{'-':>9}"
        ratio = f"{row['ratio']:6.3f} {row['paired_ratio']:6.3f}" if "ratio" in row else f"{'-':>6} {'-':>6}"
        click.echo(f"{row['config']:<30} {row['commlab_s'] * 1e3:10.2f} {row['predicted_s'] * 1e3:8.2f} {torch_ms} {ratio} {row['commlab_samples_per_s']:9.1f} "
                   f"{row['bubble_measured']:6.3f} {row['idle_waiting']:6.3f} {row['idle_data_ready']:6.3f} {row['bubble_simulated']:6.3f} {row['bubble_replayed']:6.3f} "
                   f"{row['bubble_formula']:7.3f} {row['comm_latency_s'] * 1e3:6.2f} {first / 2**20:10.2f}")  # fmt: skip


def _register_plan() -> None:
    from commlab.pipeline.cli_plan import plan

    pipeline.add_command(plan)


_register_plan()
