"""`commlab validate`: the cost model's predictions against measurement on held-out work.

    commlab validate ddp --out results/predict-validation     the DDP predictor and tune's pick
    commlab validate sharded --out results/sharded-validation the ZeRO predictor and its memory model
    commlab validate planner --budget-mb 26 --all-plans ...    the pipeline planner (pipeline plan --validate)
    commlab validate torch-answer --model mlp                  tune's torch answer, with torch's own DDP
    commlab validate published --out results/published         the what-if model against published tables

Each calibrates first (never on a configuration it then predicts), measures the grid forward and
in reverse, and prints the median and worst error; ``published`` measures nothing: it compares
with papers' tables (commlab/validation/published/). The work lives in commlab/validation/; this
module holds click declarations only, and imports torch inside the commands.
"""

from __future__ import annotations

from pathlib import Path

import click

from commlab.cli.renamed import add_old_spelling

@click.group("validate")
def validate() -> None:
    """Predictions against measurement on work the model was not fitted on."""


def _run_options(out: str, iters: int):
    """--out, --calibration and --iters, which every held-out grid takes."""
    def decorate(command):
        for option in reversed([
            click.option("--out", type=click.Path(file_okay=False, path_type=Path), default=Path(out), show_default=True,
                         help="results directory (measured, predicted, comparison)"),
            click.option("--calibration", type=click.Path(dir_okay=False, path_type=Path), default=None,
                         help="calibration file [OUT/calibration.json]; calibration always runs again (the machine drifts)"),
            click.option("--iters", default=iters, show_default=True, help="measured steps per configuration and direction"),
        ]):
            command = option(command)
        return command
    return decorate


@validate.command("ddp")
@_run_options("results/predict-validation", 12)
@click.option("--oversubscribed/--no-oversubscribed", default=True, show_default=True,
              help="also world sizes 3 and 4 (about 4 more minutes)")
@click.option("--part", "chosen", multiple=True,
              help="only this part of the grid (repeatable; each about 3-5 minutes, to split the run; "
                   "the parts: commlab/validation/ddp.py's PARTS) [all]")
def ddp(out: Path, calibration: Path | None, iters: int, oversubscribed: bool, chosen: tuple[str, ...]) -> None:
    """Calibrate, then measure and predict the held-out DDP grid, forward and in reverse."""
    from commlab.validation.ddp import PARTS, validate_parts

    unknown = sorted(set(chosen) - set(PARTS))
    if unknown:
        raise click.BadParameter(f"{', '.join(unknown)}: the parts are {', '.join(sorted(PARTS))}", param_hint="--part")
    parts = [p for name in (chosen or PARTS) for p in PARTS[name]
             if oversubscribed or chosen or name != "oversubscribed"]
    parts = [{**p, "iters": iters, "warmup": 2} for p in parts]
    validate_parts(parts, out, calibration or out / "calibration.json", echo=lambda line: click.echo(line, err=True))


@validate.command("sharded")
@_run_options("results/sharded-validation", 10)
@click.option("--model", default="gpt", show_default=True, help="the workload (as sweep --model)")
@click.option("--model-args", default=None, help="its sizes, key=value,... [the held-out GPT's]")
@click.option("--global-batch", default=None, type=click.IntRange(min=1), help="samples per step [the held-out GPT's]")
def sharded(out: Path, calibration: Path | None, iters: int, model: str, model_args: str | None,
            global_batch: int | None) -> None:
    """Calibrate, then measure and predict the held-out sharded grid (stages, buckets, prefetch)."""
    from commlab.validation.sharded import HELD_OUT, validate as run

    part = {"model": model, "model_args": HELD_OUT["model_args"] if model_args is None else model_args,
            "global_batch": HELD_OUT["global_batch"] if global_batch is None else global_batch}
    run(out, calibration or out / "calibration.json", iters, echo=lambda line: click.echo(line, err=True), part=part)


@validate.command("planner", context_settings={"ignore_unknown_options": True, "help_option_names": []})
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def planner(args: tuple[str, ...]) -> None:
    """The pipeline planner's predictions and pick measured: `pipeline plan --validate` with these options."""
    from commlab.cli.pipeline_plan import plan

    given = list(args)
    plan.main(args=given if "--help" in given or "-h" in given else ["--validate", *given],
              prog_name="commlab validate planner")


@validate.command("torch-answer")
@click.option("--model", default="mlp", show_default=True, help="the workload (as sweep --model)")
@click.option("--model-args", default="", help="the model's sizes, key=value,...")
@click.option("--grid", default="1,5,25,100", show_default=True, help="bucket_cap_mb values measured beside the pick")
@click.option("--world-size", default=2, show_default=True, help="ranks")
@click.option("--batch-per-rank", default=32, show_default=True, help="samples per rank per step")
@click.option("--iters", default=20, show_default=True, help="measured steps per bucket cap")
@click.option("--calibration", type=click.Path(dir_okay=False), default=None, help="calibration file [the default]")
@click.option("--force", is_flag=True, help="measure the search's pick even from an unsteady calibration")
def torch_answer(model, model_args, grid, world_size, batch_per_rank, iters, calibration, force) -> None:
    """Measure tune's torch answer with torch's own DDP against a grid of bucket caps."""
    try:
        grid_mb = [float(v) for v in grid.split(",") if v]
    except ValueError:
        raise click.BadParameter(f"--grid takes numbers separated by commas, got {grid!r}") from None
    from commlab.validation.torch_answer import TOLERANCE, check

    out = check(model, model_args, grid_mb=grid_mb, world_size=world_size, batch_per_rank=batch_per_rank,
                iters=iters, calibration=calibration, force=force, echo=lambda line: click.echo(line, err=True))
    for label, s in sorted(out["medians"].items(), key=lambda kv: kv[1]):
        click.echo(f"  {label:24s} {s * 1e3:8.1f} ms (torch DDP, measured)")
    click.echo(f"pick {out['pick']} {out['pick_s'] * 1e3:.1f} ms vs grid best {out['best']} {out['best_s'] * 1e3:.1f} ms: "
               f"{out['over'] * 100:+.1f}% ({'within' if out['within'] else 'NOT within'} {TOLERANCE:.0%})")


@validate.command("published")
@click.option("--table", "tables", multiple=True,
              help="only this published table (repeatable; the tables: commlab/validation/published's SOURCES) [all]")
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), default=Path("results/published-validation"),
              show_default=True, help="where published.csv and the figure published.png/.pdf go")
def published(tables: tuple[str, ...], out: Path) -> None:
    """Published results (Megatron-LM's and Korthikanti et al.'s tables, ...) against the what-if model."""
    from commlab.validation.published import SOURCES
    from commlab.validation.published.report import collect, draw, lines, write_csv

    try:
        rows = collect(SOURCES, tables)
    except ValueError as err:
        raise click.BadParameter(str(err), param_hint="--table") from None
    for line in lines(rows):
        click.echo(line)
    written = [write_csv(rows, out / "published.csv"), *draw(rows, out / "published")]
    click.echo("wrote " + ", ".join(str(p) for p in written), err=True)


for _command in (ddp, sharded, torch_answer):
    add_old_spelling(_command, "calibration", "--profile")
