"""`commlab plan`: the fastest (tp, pp, dp) layout x micro-batches x schedule x recompute under a budget, and its check.

Only option parsing loads with this one; torch and the cost model load in the command.
"""

from __future__ import annotations

import click

from commlab.cli.pipeline_options import ints as _ints, names as _names


@click.command()
@click.option("--model", "model_name", required=True, help="gpt or package.module:factory (a ModuleList of blocks)")
@click.option("--model-args", help="its sizes as key=value,...")
@click.option("--tp-plan", help="the tensor-parallel plan: package.module:function returning it [gpt: commlab.tensor.gpt_plan]")
@click.option("--world", default=2, show_default=True, type=click.IntRange(min=1), help="ranks: tp x pp x dp")
@click.option("--layout", "pinned", multiple=True, help="only these layouts, each TPxPPxDP (e.g. 2x1x1) [every one of --world]")
@click.option("--batch", default=16, show_default=True, type=click.IntRange(min=1), help="global mini-batch size")
@click.option("--microbatches", "-m", default="1,2,4", show_default=True, help="comma-separated")
@click.option("--schedules", default="gpipe,1f1b", show_default=True, help="pipeline schedules (pp > 1)")
@click.option("--checkpoint", "checkpoints", default="never,always", show_default=True, help="recompute modes: never, always")
@click.option("--budget-mb", default=64.0, show_default=True, type=click.FloatRange(min=0, min_open=True), help="per-rank memory, MiB")
@click.option("--validate", "check", is_flag=True, help="then measure every plan on --world Gloo ranks, alternating")
@click.option("--iters", default=8, show_default=True, type=click.IntRange(min=1), help="--validate: timed rounds")
@click.option("--warmup", default=1, show_default=True, type=click.IntRange(min=0), help="--validate: untimed rounds")
@click.option("--timeout", default=900.0, show_default=True, type=click.FloatRange(min=0, min_open=True), help="seconds")
def plan(model_name, model_args, tp_plan, world, pinned, batch, microbatches, schedules, checkpoints, budget_mb, check, iters, warmup,
         timeout) -> None:  # fmt: skip
    """Every (tp, pp, dp) with tp x pp x dp = --world, priced on the simulator core before any runs.

    A layout's tensor-parallel share is profiled in this process at the split shapes, its
    collectives recorded from the real operators and priced by an all-reduce table measured once;
    pipelines are the pipeline planner's. --validate then measures every plan, those over the budget too.
    """
    from commlab.cli.pipeline_plan import _sizes
    from commlab.costmodel.planner import layout_search as search
    from commlab.costmodel.planner.layouts import check_layout, layouts

    sizes = _sizes(model_name, model_args)
    ms = _ints(microbatches, "--microbatches")
    modes = _names(checkpoints, tuple(search.RECOMPUTE), "--checkpoint")
    names = _names(schedules, ("gpipe", "1f1b"), "--schedules")
    try:
        tp_layout, heads = search.model_plan(model_name, sizes, tp_plan)
    except ValueError as err:
        raise click.BadParameter(str(err), param_hint="--tp-plan") from None
    try:
        candidates = [check_layout(*_triple(text), world, heads) for text in pinned] or layouts(world, heads)
        search.check_plan(model_name, sizes, tp_layout, candidates)
    except ValueError as err:
        raise click.BadParameter(str(err), param_hint="--layout") from None
    click.echo(f"layouts of {world} ranks: " + ", ".join(map(str, candidates)))

    args = dict(name=model_name, sizes=sizes, plan=tp_layout, world=world, batch=batch, microbatches=ms, checkpoints=modes, heads=heads)
    # Every share profiled on every rank at once, as the ranks will compute (tp_calibrate.py).
    profiles = search.co_profiles(world, **args) if world > 1 else search.split_profiles(**args)
    profiles = {k: p for k, p in profiles.items() if any((lay.tp, lay.dp) == k[:2] and lay.pp == 1 for lay in candidates)}
    plans, points, system = [], None, None
    if any(lay.pp > 1 for lay in candidates):
        if any(lay.pp > 1 and (lay.tp > 1 or lay.dp > 1) for lay in candidates):
            click.echo("pipelines of tensor-parallel stages and pipeline x data parallel layouts are not planned yet: left out")
        if any(lay.pp == world for lay in candidates):
            plans, points, system = search.pipeline_plans(model_name, sizes, batch, ms, world, names, modes, click.echo)
    system = search.costs(profiles, click.echo, *([system] if system else []))
    plans += search.accumulate_plans(profiles, world, system)
    budget = budget_mb * 2**20
    chosen = search.best(plans, budget)
    click.echo("\n".join(search.table(plans, budget)))
    over = sum(p.peak_bytes > budget for p in plans)
    click.echo(f"{over} of {len(plans)} plans over {budget_mb:g} MiB per rank")
    if chosen is None:
        raise click.ClickException(f"no plan fits {budget_mb:g} MiB per rank")
    click.echo(f"plan: {chosen.describe()}: predicted {chosen.step_time * 1e3:.2f} ms, peak {chosen.peak_bytes / 2**20:.2f} MiB per rank")
    if check:
        from commlab.validation.layouts import measure, report

        common = dict(model=model_name, sizes=sizes, plan=tp_layout, batch=batch, iters=iters, warmup=warmup, timeout=timeout)
        if points is not None:
            common["points"] = points
        click.echo(f"\nvalidating: {len(plans)} plans (every one), {world} Gloo ranks, {iters} timed rounds after {warmup}, "
                   "alternating forward / reverse")  # fmt: skip
        click.echo("\n".join(report(measure(plans, world, common), chosen, budget)))


def _triple(text: str) -> tuple[int, int, int]:
    try:
        tp, pp, dp = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise ValueError(f"a layout is TPxPPxDP, e.g. 2x1x1; got {text!r}") from None
    return tp, pp, dp
