"""`commlab pipeline plan`: the fastest pipeline plan under a per-rank memory budget, and its check.

Only option parsing loads with this one; torch and the cost model load in the command.
"""

from __future__ import annotations

from pathlib import Path

import click

from commlab.cli.pipeline_options import OPTIMIZERS, SCHEDULE_NAMES, ints as _ints, names as _names
from commlab.pipeline.schedule.registry import REGISTRY
from commlab.pipeline.schedule.validate import CHECKPOINT_MODES


@click.command()
@click.option("--ranks", "-p", default=2, show_default=True, type=click.IntRange(min=1))
@click.option("--budget-mb", default=64.0, show_default=True, type=click.FloatRange(min=0, min_open=True), help="per-rank memory budget, MiB")
@click.option("--schedules", default=",".join(SCHEDULE_NAMES), show_default=True)
@click.option("--microbatches", "-m", default="2,4,8,16", show_default=True, help="comma-separated")
@click.option("--virtual", "-v", default="1,2", show_default=True, help="stages per rank to try (interleaved)")
@click.option("--checkpoint", "checkpoints", default="never,except_last,always", show_default=True)
@click.option("--depth", default=8, show_default=True, type=click.IntRange(min=1), help="MLP blocks")
@click.option("--width", default=1024, show_default=True, type=click.IntRange(min=1), help="MLP width")
@click.option("--model", "model_name", help="plan this model instead of the MLP: gpt, transformer or package.module:factory")
@click.option("--split-at", help="--model: candidate split points, comma-separated names [every block of its longest ModuleList]")
@click.option("--batch", default=64, show_default=True, type=click.IntRange(min=1), help="mini-batch size")
@click.option("--dp", default=1, show_default=True, type=click.IntRange(min=1),
              help="data-parallel degree: every stage on this many replicas, its DDP buckets all-reduced after its last backward")
@click.option("--bucket-cap-mb", type=click.FloatRange(min=0, min_open=True), help="--dp: DDP's bucket cap [DDP's default]")
@click.option("--balance", "balance_mode", default="time", show_default=True, type=click.Choice(["time", "uniform"]),
              help="split layers by profiled time, or in equal counts (as pipeline bench --balance uniform)")
@click.option("--optimizer", default="none", show_default=True, type=click.Choice(OPTIMIZERS), help="whose state the memory model counts")
@click.option("--predictions", type=click.Path(dir_okay=False, path_type=Path), help="write every plan's prediction here (CSV)")
@click.option("--top", default=8, show_default=True, type=click.IntRange(min=1), help="plans to list")
@click.option("--calibrate/--no-calibrate", default=True, show_default=True,
              help="measure the executor's per-action overhead and the per-message cost first (a few seconds on --ranks Gloo ranks)")
@click.option("--validate", "check", is_flag=True, help="then measure every plan that fits on --ranks Gloo ranks, alternating")
@click.option("--all-plans", is_flag=True,
              help="--validate: measure every plan, those over the budget too, and judge the pick against the fastest whose measured peak fits")
@click.option("--iters", default=10, show_default=True, type=click.IntRange(min=1), help="--validate: timed rounds")
@click.option("--warmup", default=2, show_default=True, type=click.IntRange(min=0), help="--validate: untimed rounds")
@click.option("--timeout", default=600.0, show_default=True, type=click.FloatRange(min=0, min_open=True), help="--validate: seconds")
def plan(ranks, budget_mb, schedules, microbatches, virtual, checkpoints, depth, width, model_name, split_at, batch, dp, bucket_cap_mb,
         balance_mode, optimizer, predictions, top, calibrate, check, all_plans, iters, warmup, timeout) -> None:  # fmt: skip
    """The fastest plan (schedule x micro-batches x stages per rank x checkpointing) under a per-rank memory budget.

    Layers are profiled at each micro-batch size, and every plan is predicted on the shared
    simulator core with its peak memory per rank. ``--validate`` then measures the grid. ``--dp N``:
    each plan is one of N replicas (``--batch`` each), its stages' DDP buckets all-reduced.
    ``--model``: any model the splitter cuts by name, its blocks the layers, the plan's split points printed.
    """
    import os

    from commlab.costmodel.pipeline import DataParallel

    from commlab.costmodel.plan import best, candidates, no_fit, table
    from commlab.costmodel.plan_profile import profile_mlp
    from commlab.costmodel.plan_calibrate import plan_costs, profile_line
    from commlab.costmodel.plan_standin import calibration_schedules

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
    if dp > 1 and not calibrate and profile_line(dp) is None:
        raise click.UsageError(f"--dp {dp} --no-calibrate needs a DDP calibration at world size {dp} on this machine: "
                               "drop --no-calibrate to measure the all-reduce")  # fmt: skip
    if model_name is not None and check:
        raise click.BadParameter("--validate measures the MLP only", param_hint="--model")
    if split_at is not None and model_name is None:
        raise click.BadParameter("--split-at names split points of --model", param_hint="--split-at")
    points = None
    # Every stage a plan can have is timed whole, as the executor runs it (costmodel/plan_stages.py).
    priced = dict(ranks=ranks, virtuals=_ints(virtual, "--virtual"), schedules=names, balance_mode=balance_mode)
    if model_name is None:
        profiles = profile_mlp(depth, width, batch, ms, ranks * dp, priced)
    else:
        from commlab.costmodel.plan_model import profile_model, split_points

        try:
            profiles, points = profile_model(model_name, batch, ms, ranks * dp, split_at and split_at.split(","), plans=priced)
        except ValueError as err:
            raise click.BadParameter(str(err), param_hint="--model") from None
    parallel = DataParallel(dp, bucket_cap_mb=bucket_cap_mb) if dp > 1 else None
    # Each schedule's executor overhead and compute stretch on stand-in stages with a typical
    # boundary (the median layer output): plan_calibrate.schedule_costs.
    boundary = {m: sorted(p.output)[len(p.output) // 2] for m, p in profiles.items()}
    costs, overheads = plan_costs(profiles.values(), ranks, dp, measure=calibrate, timeout=timeout, echo=click.echo,
                                  schedules=calibration_schedules(ranks, names, priced["virtuals"], boundary,
                                                                  len(next(iter(profiles.values())).seconds)))  # fmt: skip
    # Ranks beyond the cores share them: each rank's compute slows while others compute.
    plans = candidates(profiles, ranks, _ints(virtual, "--virtual"), modes, names, costs, os.cpu_count(), parallel,
                       balance_mode=balance_mode, optimizer=optimizer, overheads=overheads)  # fmt: skip
    if not plans:
        raise click.UsageError("no schedule applies (with --dp, zero-bubble schedules are not supported by the hybrid runtime)")
    budget = budget_mb * 2**20
    chosen = best(plans, budget)
    click.echo("\n".join(table(plans[:top], budget)))
    if predictions is not None:
        from commlab.costmodel.plan_check import write_predictions

        click.echo(f"wrote {write_predictions(predictions, plans)} predictions to {predictions}")
    if chosen is None:
        raise click.ClickException(no_fit(plans, budget_mb))
    click.echo(f"plan: {chosen.schedule}, m={chosen.microbatches}, v={chosen.virtual}, checkpoint {chosen.checkpoint}, "
               f"balance {list(chosen.balance)}: predicted {chosen.step_time * 1e3:.2f} ms, peak {max(chosen.peak_bytes) / 2**20:.2f} MiB per rank")  # fmt: skip
    if points is not None:
        click.echo(f"split points: {split_points(points, chosen.balance)}")
    if check:
        _plan_check(plans if all_plans else [p for p in plans if max(p.peak_bytes) <= budget], chosen, ranks,
                    dict(depth=depth, width=width, batch=batch, iters=iters, warmup=warmup, timeout=timeout),
                    budget if all_plans else None)  # fmt: skip


def _plan_check(fitting, chosen, ranks: int, common: dict, budget: float | None = None) -> None:
    from commlab.costmodel.plan_check import measure_grid

    what = "plans (every one)" if budget is not None else "plans that fit"
    click.echo(f"\nvalidating: {len(fitting)} {what}, {ranks} Gloo ranks, {common['iters']} timed rounds after "
               f"{common['warmup']}, plans alternating forward / backward each round")  # fmt: skip
    click.echo("\n".join(measure_grid(fitting, chosen, ranks, common, budget)))
