"""`commlab pipeline`: print a schedule, simulate it, benchmark the executor against torch, plan a run.

    commlab pipeline show --schedule 1f1b --ranks 4 --microbatches 8       the step x rank grid
    commlab pipeline show --schedule 1f1b --ranks 2 --comm gloo            ... its lists with SEND, RECV, WAIT
    commlab pipeline simulate --ranks 4 --microbatches 8 --backward 2      bubble of every schedule
    commlab pipeline bench --microbatches 2,4,8                            commlab vs torch, CSV + figures
    commlab pipeline plan --ranks 2 --budget-mb 64                         fastest plan under a memory budget
    commlab pipeline plan --ranks 2 --budget-mb 64 --validate              ... and its pick measured against the grid
    commlab pipeline plan --ranks 2 --budget-mb 64 --validate --all-plans  ... every plan, judged by measured peaks
    commlab pipeline plan --ranks 2 --dp 2 --budget-mb 64                  ... as one of 2 data-parallel replicas
    commlab pipeline plan --model gpt --ranks 2 --budget-mb 64             ... of any model, split by name

Only the pure schedule modules load with this one; torch, pandas and the runtime load in the commands.
"""

from __future__ import annotations

import time
from pathlib import Path

import click

from commlab.cli.bench import _OVERSUBSCRIBE, _check_capacity
from commlab.cli.pipeline_options import SCHEDULE_NAMES, ints as _ints, names as _names
from commlab.cli.pipeline_plan import plan
from commlab.cli.writable import check_writable
from commlab.pipeline.schedule.actions import format_actions, from_csv
from commlab.pipeline.schedule.comm import BACKENDS, lower_comm
from commlab.pipeline.schedule.registry import REGISTRY, build
from commlab.pipeline.schedule.render import grid
from commlab.pipeline.schedule.simulate import bubble_formula
from commlab.pipeline.schedule.simulate import simulate as run_simulation
from commlab.pipeline.schedule.checks import CHECKPOINT_MODES, check_plan, check_schedule

BALANCE_MODES = ("uniform", "time", "size")
# The most (rank, micro-batch, stage-per-rank) triples one schedule is simulated for. Building,
# checking and simulating grow faster than linearly in them (zb-v's ordering re-simulates the
# list once per I): at 512, zb-v at p = 16, m = 16 takes about 6 s on a laptop core, every other
# schedule under 1 s; p = 1000, m = 4 ran for over 10 minutes.
SIMULATE_LIMIT = 512


def _virtual(schedule: str, virtual: int) -> int:  # the schedule's own stages per rank, else --virtual
    return virtual if REGISTRY[schedule].virtual is None else REGISTRY[schedule].virtual[0]


def _actions(schedule: str, ranks: int, microbatches: int, virtual: int):
    try:
        actions = build(schedule, ranks, microbatches, _virtual(schedule, virtual))
        check_schedule(actions)
    except ValueError as err:
        raise click.UsageError(str(err)) from None
    return actions


@click.group("pipeline")
def pipeline() -> None:
    """Pipeline schedules: show, simulate, benchmark, plan."""


@pipeline.command()
@click.option("--schedule", default="1f1b", show_default=True, type=click.Choice(SCHEDULE_NAMES), help="the schedule to print")
@click.option("--csv", "csv_path", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="show a schedule read from torch.distributed.pipelining's compute-only CSV instead")
@click.option("--ranks", "-p", default=4, show_default=True, type=click.IntRange(min=1), help="pipeline ranks")
@click.option("--microbatches", "-m", default=8, show_default=True, type=click.IntRange(min=1), help="micro-batches per step")
@click.option("--virtual", "-v", default=2, show_default=True, type=click.IntRange(min=1), help="stages per rank (interleaved; zb-v: always 2)")
@click.option("--actions", "as_actions", is_flag=True, help="print each rank's action list instead of the grid")
@click.option("--comm", type=click.Choice(BACKENDS), help="print each rank's list after the comm pass for this backend")
@click.option("--backward", type=click.IntRange(min=1), help="ticks per backward (I and W: half each) [1, or 2 for I/W schedules]")
def show(schedule, csv_path, ranks, microbatches, virtual, as_actions, comm, backward) -> None:
    """Print a schedule's step x rank grid (unit times for F, B, I and W; '.' is idle; '~' a part of an overlapped pair)."""
    if csv_path is not None:
        try:
            actions = from_csv(csv_path.read_text())
            check_schedule(actions)
        except ValueError as err:
            raise click.UsageError(str(err)) from None
    else:
        actions = _actions(schedule, ranks, microbatches, virtual)
    if as_actions or comm:
        for r, line in enumerate(format_actions(lower_comm(actions, backend=comm) if comm else actions)):
            click.echo(f"rank {r}: {line}")
    else:
        try:
            click.echo(grid(actions, backward))
        except ValueError as err:
            raise click.BadParameter(str(err), param_hint="--backward") from None


@pipeline.command()
@click.option("--schedules", default=",".join(SCHEDULE_NAMES), show_default=True,
              help="comma-separated schedules to simulate (by default those this --microbatches can fill)")
@click.option("--ranks", "-p", default=4, show_default=True, type=click.IntRange(min=1), help="pipeline ranks")
@click.option("--microbatches", "-m", default="8", show_default=True, help="comma-separated micro-batch counts")
@click.option("--virtual", "-v", default=2, show_default=True, type=click.IntRange(min=1),
              help="stages per rank of interleaved, looped-bfs and interleaved-zb (the others fix theirs)")
@click.option("--forward", default=1.0, show_default=True, type=click.FloatRange(min=0), help="a stage's forward time")
@click.option("--backward", default=2.0, show_default=True, type=click.FloatRange(min=0), help="a stage's backward time")
@click.option("--comm", default=0.0, show_default=True, type=click.FloatRange(min=0), help="time per cross-rank message")
@click.option("--figure", type=click.Path(dir_okay=False, path_type=Path), help="also save the Gantt charts here (.png)")
def simulate(schedules, ranks, microbatches, virtual, forward, backward, comm, figure) -> None:
    """Step time, bubble and activations in flight of schedules with uniform stage times.

    Interleaved stages each do 1/v of a rank's work, so all schedules compare on the same model.
    """
    panels, skipped = [], []
    # Named schedules must all run; the default list skips those this m cannot fill (dualpipev
    # needs at least as many micro-batches as stages) and says so, rather than failing.
    named = click.get_current_context().get_parameter_source("schedules") != click.core.ParameterSource.DEFAULT
    ms, names = _ints(microbatches, "--microbatches"), _names(schedules, tuple(REGISTRY), "--schedules")
    for name in names:  # before any output: a size too large to simulate in seconds is refused
        v = _virtual(name, virtual)
        if ranks * max(ms) * v > SIMULATE_LIMIT:
            raise click.UsageError(f"{name} at p={ranks}, m={max(ms)}" + (f", v={v}" if v > 1 else "") + ": "
                                   f"{ranks * max(ms) * v} rank x micro-batch x stage-per-rank triples, over the "
                                   f"{SIMULATE_LIMIT} simulated here (the time grows faster than linearly): use fewer "
                                   "ranks or micro-batches")
    width = max(len("schedule"), *(len(n) for n in REGISTRY))
    click.echo(f"{'schedule':<{width}} {'m':>4} {'step':>9} {'bubble':>8} {'formula':>8}  peak in flight per stage")
    for m in ms:
        for name in names:
            v = _virtual(name, virtual)
            try:
                actions = _actions(name, ranks, m, v)
            except click.UsageError as err:
                if named:
                    raise
                skipped.append(f"{name} at m={m}: {err.message}")
                continue
            sim = run_simulation(actions, forward / v, backward / v, comm)
            # The closed form is GPipe's / 1F1B's / interleaved's; a split backward has none here.
            formula = f"{bubble_formula(ranks, m, v):8.3f}" if "I" not in REGISTRY[name].kinds else f"{'-':>8}"
            click.echo(f"{name:<{width}} {m:>4} {sim.step_time:>9.3f} {sim.bubble:>8.3f} {formula}  {list(sim.peak_in_flight)}")
            panels.append((f"{name}, p={ranks}, m={m}" + (f", v={v}" if v > 1 else ""), sim.timeline, sim.messages))
    for line in skipped:
        click.echo(f"skipped {line}")
    if figure:
        from commlab.pipeline.schedule.render import gantt_figure  # matplotlib: only when drawing

        gantt_figure(panels, ranks, str(figure))
        click.echo(f"wrote {figure}")


@pipeline.command()
@click.option("--schedules", default=",".join(SCHEDULE_NAMES), show_default=True, help="comma-separated schedules to run")
@click.option("--microbatches", "-m", default="2,4,8", show_default=True, help="comma-separated")
@click.option("--balance", "balance_modes", default="time", show_default=True, help="uniform,time,size")
@click.option("--checkpoint", "checkpoints", default="never", show_default=True, help="never,except_last,always")
@click.option("--world-size", default=2, show_default=True, type=click.IntRange(min=2), help="pipeline ranks, one process each")
@click.option("--backend", default="gloo", show_default=True, type=click.Choice(["auto", "gloo", "nccl"]),
              help="process group backend; auto: NCCL when every rank has its own GPU, else Gloo")
@click.option("--virtual", "-v", default=2, show_default=True, type=click.IntRange(min=1), help="stages per rank (interleaved; zb-v: always 2)")
@click.option("--depth", default=8, show_default=True, type=click.IntRange(min=1), help="MLP blocks")
@click.option("--width", default=1024, show_default=True, type=click.IntRange(min=1), help="MLP width")
@click.option("--batch", default=64, show_default=True, type=click.IntRange(min=1), help="mini-batch size")
@click.option("--iters", default=10, show_default=True, type=click.IntRange(min=1), help="timed steps each")
@click.option("--warmup", default=3, show_default=True, type=click.IntRange(min=0), help="untimed steps each")
@click.option("--calibrate", default=3, show_default=True, type=click.IntRange(min=1), help="commlab steps before the timed ones that calibrate the prediction")
@click.option("--out", default="results", show_default=True, type=click.Path(file_okay=False, path_type=Path),
              help="parent directory of results")
@click.option("--name", help="results sub-directory [pipeline-<time>]")
@click.option("--timeout", default=600.0, show_default=True, type=click.FloatRange(min=0, min_open=True), help="seconds")
@click.option("--no-figures", is_flag=True, help="write the CSVs only")
@click.option("--against", type=click.Choice(["torch"]),
              help="instead: the GPT (--depth blocks of --width) in separate launches, commlab and torch alternating; the step-time ratio")
@click.option("--launches", default=6, show_default=True, type=click.IntRange(min=1), help="--against: launches of each")
@_OVERSUBSCRIBE
def bench(schedules, microbatches, balance_modes, checkpoints, world_size, backend, virtual, depth, width, batch,
          iters, warmup, calibrate, out, name, timeout, no_figures, against, launches, oversubscribe) -> None:  # fmt: skip
    """commlab's pipeline vs torch.distributed.pipelining, alternating; bubble, memory, figures.

    Ctrl-C keeps the rows of every configuration already measured (exit status 130).
    """
    from commlab.runtime import resolve_backend

    check_writable(out)
    try:
        resolved = resolve_backend("gloo" if against and backend == "auto" else backend, world_size)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--backend") from None
    if resolved == "gloo":  # CPU ranks: the machine must host them before the model is even split
        _check_capacity(world_size, 0, oversubscribe)
    if against:
        return _against(_names(schedules, tuple(REGISTRY), "--schedules"), _ints(microbatches, "--microbatches"), world_size,
                        backend, launches, dict(layers=depth, d_model=width, batch=batch, iters=iters, warmup=warmup), timeout,
                        out / (name or time.strftime("pipeline-against-%Y%m%d-%H%M%S")) / "against.csv")  # fmt: skip
    from commlab.bench.pipeline_bench import balance

    backend = resolved
    common = dict(depth=depth, width=width, batch=batch, iters=iters, warmup=warmup, calibrate=calibrate, timeout=timeout)
    configs = []
    balances: dict[tuple[str, int], list[int]] = {}  # one balance per mode and stage count, shared by all schedules
    ms = _ints(microbatches, "--microbatches")
    for schedule in _names(schedules, tuple(REGISTRY), "--schedules"):
        v = _virtual(schedule, virtual)
        for mode in _names(balance_modes, BALANCE_MODES, "--balance"):
            if (mode, world_size * v) not in balances:
                try:  # profiled at the micro-batch size the pipeline runs (the smallest asked for)
                    balances[(mode, world_size * v)] = balance(mode, depth, width, max(1, batch // max(ms)), world_size * v, world_size)
                except ValueError as err:
                    raise click.BadParameter(str(err), param_hint="--world-size") from None
            for m in ms:
                if m > batch:
                    raise click.BadParameter(f"{m} micro-batches need a batch of at least {m}, got {batch}", param_hint="--microbatches")
                for ck in _names(checkpoints, CHECKPOINT_MODES, "--checkpoint"):
                    try:
                        check_plan(schedule, world_size * v, world_size, m, ck, REGISTRY[schedule].placement(world_size, world_size * v))
                    except ValueError as err:
                        raise click.UsageError(f"{schedule}, m={m}: {err}") from None
                    # torch's Schedule1F1B refuses fewer micro-batches than stages (its __init__), on the ranks
                    if REGISTRY[schedule].torch == "Schedule1F1B" and m < world_size * v:
                        raise click.UsageError(f"{schedule}, m={m}: torch's Schedule1F1B, run beside it, needs at least as "
                                               f"many micro-batches as stages ({world_size * v}): raise --microbatches")
                    configs.append(dict(config=f"{schedule}-m{m}-{mode}-{ck}", schedule=schedule, microbatches=m, balance_mode=mode,
                                        balance=balances[(mode, world_size * v)], checkpoint=ck, virtual=v))  # fmt: skip
    run_dir = out / (name or time.strftime("pipeline-%Y%m%d-%H%M%S"))
    click.echo(f"{len(configs)} configurations, world {world_size}, {backend}, MLP {depth} x {width}, batch {batch}; "
               f"{iters} timed steps each after {warmup}, commlab and torch alternating -> {run_dir}")  # fmt: skip
    from commlab.bench.pipeline_bench import run  # torch: only when a run starts
    from commlab.runtime.metadata import command_line

    run(run_dir, configs, common, world_size, backend, no_figures, command_line(click.get_current_context()))


def _against(schedules, ms, world_size, backend, launches, sizes, timeout, csv_path: Path) -> None:
    from commlab.bench import pipeline_against as against

    try:
        against.check(schedules, ms, world_size, launches, sizes)
    except ValueError as err:
        raise click.UsageError(str(err)) from None
    backend = "gloo" if backend == "auto" else backend
    rows = [against.against_torch(s, m, launches, world_size, backend, timeout, click.echo, **sizes) for s in schedules for m in ms]
    against.write_csv(csv_path, rows)
    click.echo("\n".join(against.summary(row) for row in rows) + f"\nwrote {csv_path}")


pipeline.add_command(plan)
