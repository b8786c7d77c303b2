"""`commlab pipeline plan`: the fastest pipeline plan under a per-rank memory budget, and its check.

Only option parsing loads with this one; torch and the cost model load in the command.
"""

from __future__ import annotations

from pathlib import Path

import click

from commlab.cli.pipeline_options import OPTIMIZERS, SCHEDULE_NAMES, ints as _ints, names as _names
from commlab.cli.writable import check_writable
from commlab.pipeline.schedule.registry import REGISTRY
from commlab.pipeline.schedule.checks import CHECKPOINT_MODES


@click.command()
@click.option("--ranks", "-p", default=2, show_default=True, type=click.IntRange(min=1), help="pipeline ranks (with --dp: per replica)")
@click.option("--budget-mb", default=64.0, show_default=True, type=click.FloatRange(min=0, min_open=True), help="per-rank memory budget, MiB")
@click.option("--schedules", default=",".join(SCHEDULE_NAMES), show_default=True, help="comma-separated schedules to plan with")
@click.option("--microbatches", "-m", default="2,4,8,16", show_default=True, help="comma-separated")
@click.option("--virtual", "-v", default="1,2", show_default=True, help="stages per rank to try (interleaved)")
@click.option("--checkpoint", "checkpoints", default="never,except_last,always", show_default=True,
              help="comma-separated activation checkpointing modes to try: never, except_last (every micro-batch but the last), always")
@click.option("--depth", default=8, show_default=True, type=click.IntRange(min=1), help="MLP blocks")
@click.option("--width", default=1024, show_default=True, type=click.IntRange(min=1), help="MLP width")
@click.option("--model", "model_name", help="plan this model instead of the MLP: gpt, transformer or package.module:factory")
@click.option("--model-args", help="--model: its sizes as key=value,... e.g. d_model=256,layers=8")
@click.option("--split-at", help="--model: candidate split points, comma-separated names [every block of its longest ModuleList]")
@click.option("--batch", default=64, show_default=True, type=click.IntRange(min=1), help="mini-batch size")
@click.option("--dp", default=1, show_default=True, type=click.IntRange(min=1),
              help="data-parallel degree: every stage on this many replicas, its DDP buckets all-reduced after its last backward")
@click.option("--bucket-cap-mb", type=click.FloatRange(min=0, min_open=True), help="--dp: DDP's bucket cap in MiB [DDP's default, 25]")
@click.option("--balance", "balance_mode", default="time", show_default=True, type=click.Choice(["time", "uniform"]),
              help="split layers by profiled time, or in equal counts (as pipeline bench --balance uniform)")
@click.option("--optimizer", default="none", show_default=True, type=click.Choice(OPTIMIZERS), help="whose state the memory model counts")
@click.option("--predictions", type=click.Path(dir_okay=False, path_type=Path), help="write every plan's prediction here (CSV)")
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path), help="--validate: write every measured plan here (CSV)")
@click.option("--top", default=8, show_default=True, type=click.IntRange(min=1), help="plans to list")
@click.option("--calibrate/--no-calibrate", default=True, show_default=True,
              help="measure the executor's per-action overhead and the per-message cost first (a few seconds on --ranks Gloo ranks)")
@click.option("--validate", "check", is_flag=True, help="then measure every plan that fits on --ranks Gloo ranks, alternating")
@click.option("--all-plans", is_flag=True,
              help="--validate: measure every plan, those over the budget too, and judge the pick against the fastest whose measured peak fits")
@click.option("--iters", default=10, show_default=True, type=click.IntRange(min=1), help="--validate: timed rounds")
@click.option("--warmup", default=2, show_default=True, type=click.IntRange(min=0), help="--validate: untimed rounds")
@click.option("--timeout", default=600.0, show_default=True, type=click.FloatRange(min=0, min_open=True), help="--validate: seconds")
def plan(ranks, budget_mb, schedules, microbatches, virtual, checkpoints, depth, width, model_name, model_args, split_at, batch, dp,
         bucket_cap_mb, balance_mode, optimizer, predictions, out, top, calibrate, check, all_plans, iters, warmup, timeout) -> None:  # fmt: skip
    """The fastest plan (schedule x micro-batches x stages per rank x checkpointing) under a per-rank memory budget.

    Layers are profiled at each micro-batch size, and every plan is predicted on the shared
    simulator core with its peak memory per rank. --validate then measures the grid. --dp N:
    each plan is one of N replicas (--batch each), its stages' DDP buckets all-reduced.
    --model: any model the splitter cuts by name, its blocks the layers, the plan's split points printed.
    """
    import os

    from commlab.costmodel.lowering.pipeline import DataParallel

    from commlab.costmodel.planner.plan import best, candidates, no_fit, table
    from commlab.costmodel.planner.layers import profile_mlp
    from commlab.costmodel.planner.calibrate import plan_costs, calibrated_line
    from commlab.costmodel.planner.offgrid import calibration_count, calibration_runs
    from commlab.costmodel.planner.stages import needs_split, stage_ranges

    names = _names(schedules, tuple(REGISTRY), "--schedules")
    modes = _names(checkpoints, CHECKPOINT_MODES, "--checkpoint")
    ms = [m for m in _ints(microbatches, "--microbatches") if m <= batch]
    if not ms:
        raise click.BadParameter(f"every micro-batch count exceeds the batch of {batch}", param_hint="--microbatches")
    if all_plans and not check:
        raise click.BadParameter("--all-plans widens --validate: give --validate too", param_hint="--all-plans")
    if check and ranks < 2:
        raise click.BadParameter("--validate needs at least 2 ranks", param_hint="--ranks")
    if check and dp > 1:
        raise click.BadParameter("--validate measures pipeline-only plans: use --dp 1", param_hint="--dp")
    if dp > 1 and not calibrate and calibrated_line(dp) is None:
        raise click.UsageError(f"--dp {dp} --no-calibrate needs a DDP calibration at world size {dp} on this machine: "
                               "drop --no-calibrate to measure the all-reduce")  # fmt: skip
    if out is not None and not check:
        raise click.BadParameter("--out writes what --validate measures: give --validate too", param_hint="--out")
    for option, path in (("--out", out), ("--predictions", predictions)):
        if path is not None:
            check_writable(path.parent, option)
    if model_args is not None and model_name is None:
        raise click.BadParameter("--model-args sizes --model", param_hint="--model-args")
    sizes = _sizes(model_name, model_args)
    if split_at is not None and model_name is None:
        raise click.BadParameter("--split-at names split points of --model", param_hint="--split-at")
    points = None
    # Every stage a plan can have is timed whole, as the executor runs it (costmodel/plan_stages.py):
    # in the calibration launch, every rank at once, as a pipeline's ranks compute; else here.
    priced = dict(ranks=ranks, virtuals=_ints(virtual, "--virtual"), schedules=names, balance_mode=balance_mode)
    co_run = calibrate and ranks > 1 and dp == 1
    families = sorted({(n, v) for n in names for v in (REGISTRY[n].virtual or priced["virtuals"])})
    # Each schedule also runs on the model at a count no plan uses, profiled too (costmodel/plan_offgrid.py).
    count = calibration_count(families, ranks, ms, batch) if co_run else None
    profiled = ms + [count] if count else ms
    if model_name is None:
        profiles = profile_mlp(depth, width, batch, profiled, ranks * dp, None if co_run else priced)
    else:
        from commlab.costmodel.planner.model import profile_model, split_points

        try:
            profiles, points = profile_model(model_name, batch, profiled, ranks * dp, split_at and split_at.split(","),
                                             plans=None if co_run else priced, **sizes)  # fmt: skip
        except ValueError as err:
            raise click.BadParameter(str(err), param_hint="--model") from None
    parallel = DataParallel(dp, bucket_cap_mb=bucket_cap_mb) if dp > 1 else None
    model = {"model": model_name, "sizes": sizes, "points": points} if model_name else {"depth": depth, "width": width}
    stages = offgrid = None
    if co_run:
        stages = {"model": model, "batch": batch, "split": needs_split(names),
                  "ranges": {m: sorted(stage_ranges(p.seconds, ranks, priced["virtuals"], names, balance_mode)) for m, p in profiles.items()}}
    if count:
        offgrid = calibration_runs(profiles[count], count, ranks, families, balance_mode, model, batch)
    costs, overheads, profiles = plan_costs(profiles, ranks, dp, measure=calibrate, timeout=timeout, echo=click.echo, stages=stages,
                                            offgrid=offgrid)  # fmt: skip
    profiles.pop(count, None)
    # Ranks beyond the cores share them: each rank's compute slows while others compute.
    plans = candidates(profiles, ranks, _ints(virtual, "--virtual"), modes, names, costs, os.cpu_count(), parallel,
                       balance_mode=balance_mode, optimizer=optimizer, overheads=overheads)  # fmt: skip
    if not plans:
        raise click.UsageError("no schedule applies (with --dp, zero-bubble schedules are not supported by the hybrid runtime)")
    budget = budget_mb * 2**20
    chosen = best(plans, budget)
    click.echo("\n".join(table(plans[:top], budget)))
    if predictions is not None:
        from commlab.validation.planner import write_predictions

        click.echo(f"wrote {write_predictions(predictions, plans)} predictions to {predictions}")
    if chosen is None:
        raise click.ClickException(no_fit(plans, budget_mb))
    click.echo(f"plan: {chosen.schedule}, m={chosen.microbatches}, v={chosen.virtual}, checkpoint {chosen.checkpoint}, "
               f"balance {list(chosen.balance)}: predicted {chosen.step_time * 1e3:.2f} ms, peak {max(chosen.peak_bytes) / 2**20:.2f} MiB per rank")  # fmt: skip
    if points is not None:
        click.echo(f"split points: {split_points(points, chosen.balance)}")
    if check:
        common = dict(depth=depth, width=width, batch=batch, iters=iters, warmup=warmup, timeout=timeout)
        if model_name is not None:
            common.update(model=model_name, sizes=sizes, points=points)
        _plan_check(plans if all_plans else [p for p in plans if max(p.peak_bytes) <= budget], chosen, ranks, common,
                    budget if all_plans else None, out)  # fmt: skip


def _sizes(model_name: str | None, model_args: str | None) -> dict:
    """--model-args parsed and checked against --model before anything is profiled."""
    if model_name is None:
        return {}
    from commlab.models import check_workload
    from commlab.runs.options import parse_model_args

    try:
        sizes = parse_model_args(model_args or "")
        check_workload(model_name, **sizes)
    except ValueError as err:
        raise click.BadParameter(str(err), param_hint="--model-args") from None
    return sizes


def _plan_check(fitting, chosen, ranks: int, common: dict, budget: float | None = None, out: Path | None = None) -> None:
    from commlab.validation.planner import measure_grid

    what = "plans (every one)" if budget is not None else "plans that fit"
    click.echo(f"\nvalidating: {len(fitting)} {what}, {ranks} Gloo ranks, {common['iters']} timed rounds after "
               f"{common['warmup']}, plans alternating forward / backward each round")  # fmt: skip
    click.echo("\n".join(measure_grid(fitting, chosen, ranks, common, budget, out)))
