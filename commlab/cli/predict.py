"""The `commlab calibrate`, `commlab predict` and `commlab tune` commands.

\b
    commlab calibrate sweeps/bucket_size.yaml               measure what predict and tune of it need, cache it
    commlab predict sweeps/bucket_size.yaml                 a sweep's results, without running it
    commlab predict SPEC --against results/bucket_size      ... and how far off it is
    commlab predict --hardware dgx-a100-hdr200 --backend nccl --world-size 8,16,32,64,128,256 --bucket-mb 25
    commlab tune --model mlp --json                         the bucket to use, no sweep
    commlab tune --model mlp --stage auto --memory-gb 8     ... and the ZeRO stage that fits 8 GiB per rank
    commlab predict --memory --params 7.5e9 --world-size 64 the ZeRO memory model, no calibration

All three take the sweep's spec file and options (commlab/cli/sweep.py), so a prediction has the
same configurations, ids, files and columns as the measured sweep of the same spec.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import click

from commlab.cli import sweep as sweep_cli
from commlab.cli import tune_text, zero_memory  # click declarations at import; torch inside the calls
from commlab.cli.renamed import add_old_spelling
from commlab.cli.writable import check_writable

# The sweep's options about running and measuring: nothing here runs a configuration.
_RUN_ONLY = {"resume", "force", "launcher", "timeout", "nnodes", "rdzv_endpoint", "repeat"}
_GRID_ONLY = {"bucket_mb", "overlap", "accumulate", "groups", "iters", "warmup", "out", "name", "draw"}
_MEASURED = {"iters", "warmup"}  # steps a measurement takes; a prediction simulates one


def _sweep_params(drop: set[str]) -> list[click.Parameter]:
    """The sweep's own options (whatever it grows), minus those that mean nothing here."""
    return [p for p in sweep_cli.sweep.params if p.name not in drop]


def _refuse(ctx: click.Context, param: click.Parameter, value):
    if value not in (None, False, ()):
        raise click.UsageError(f"{param.opts[0]} is an option of `commlab sweep`: a prediction runs nothing, "
                               "so it does not use it", ctx)


def _refused(names: set[str]) -> list[click.Parameter]:
    """The sweep's options named, accepted by the parser but refused with a usage error when given
    (a silently ignored option would let a user believe it changed the prediction)."""
    out = []
    for p in sweep_cli.sweep.params:
        if p.name in names:
            flag = dict(is_flag=True, default=False) if getattr(p, "is_flag", False) else {}
            out.append(click.Option(p.opts, hidden=True, expose_value=False, callback=_refuse, **flag))
    return out


def _calibration() -> click.Option:
    """--calibration FILE (its old spelling --profile is added to each command below)."""
    return click.Option(["--calibration", "calibration_path"], type=click.Path(dir_okay=False, path_type=Path),
                        help="calibration file (JSON) [~/.cache/commlab/calibration.json]")


_RECAL = click.Option(["--recalibrate"], is_flag=True, help="measure again even if the calibration file holds a fresh entry")
_ECHO = lambda line: click.echo(line, err=True)  # noqa: E731


def _plan(spec_file, options, *, hardware: str | None = None):
    from commlab.sweep import runner
    from commlab.runs.grid import build_grid, merge

    spec = sweep_cli._read_spec(spec_file)
    try:
        plan = build_grid(merge(spec, {k: v for k, v in options.items() if k not in _RUN_ONLY and k != "draw"}))
        for axis in ("tp", "pp"):  # priced as DDP it would be silently wrong
            if any(getattr(cfg, axis) > 1 for cfg in plan.configs):
                raise ValueError(f"--{axis} > 1: predict and tune price data-parallel grids only (tp = pp = 1); "
                                 "sweep tensor and pipeline layouts")
        if hardware is None:
            runner.check_grid(plan)
        else:
            from commlab.models import check_workload

            for cfg in plan.configs:
                check_workload(cfg.model, **cfg.model_kwargs())
                if cfg.backend != "nccl":  # a preset is priced as NCCL prices it (costmodel/nccl.py)
                    raise ValueError(f"--hardware predicts NCCL on GPUs: give --backend nccl (got {cfg.backend})")
    except ValueError as err:
        raise click.UsageError(str(err)) from None
    return plan


def _calibrate(spec_file, calibration_path, recalibrate, **options):
    """Measure what `commlab predict` and `commlab tune` of these workloads need, and cache it (SPEC
    and the sweep's options): one entry per backend, world size, threads per rank and batch per
    rank of the grid, each with every registered all-reduce algorithm (tune searches them all),
    and with --stage 1-3 the sharded collectives. Calibrate the spec you will predict or tune."""
    from commlab.costmodel.search import grid_costs as session

    plan = _plan(spec_file, {**options, "bucket_mb": None})
    try:
        entries = session.entries_for(plan.configs, calibration_path=calibration_path, recalibrate=recalibrate,
                                      echo=_ECHO, algorithms=session.tune_algorithms())
    except ValueError as err:
        raise click.UsageError(str(err)) from None
    from commlab.costmodel.calibration.cache import key_id

    for entry in entries.values():
        c = entry["compute"]
        click.echo(f"{key_id(entry['key'])}: forward {c['forward_s'] * 1e3:.1f} ms, backward "
                   f"{c['ready_s'][-1] * 1e3:.1f} ms, optimizer {c['optimizer_s'] * 1e3:.1f} ms, co-run x{c['corun']:.2f}, "
                   f"write-back {c['writeback_s_per_byte'] * 2**30:.1f} s/GiB, bucket {c['bucket_fixed_s'] * 1e3:.2f} ms")
        if "steadiness" in entry:
            from commlab.costmodel.terms.uncertainty import Steadiness

            click.echo(f"  calibration {Steadiness.from_json(entry['steadiness']).describe()}")
        for algorithm, fit in entry["collectives"].items():
            k = entry["contention"].get(algorithm, {})
            worst = max(abs(r) for r in fit["line_residuals"])
            click.echo(f"  {algorithm}: alpha {fit['alpha_s'] * 1e3:.2f} ms, beta {fit['beta_bytes_per_s'] / 1e9:.2f} GB/s "
                       f"(line off by up to {worst * 100:.0f}%; table used), kc {k.get('kc', 0):.2f}, km {k.get('km', 0):.2f}")


def _predict(spec_file, against, calibration_path, recalibrate, hardware, draw, memory, num_params, precision, **options):
    """Predict a sweep (SPEC and the sweep's options) from a calibration: same files, ids, columns
    and figures as `commlab sweep`, with a `source` column saying `predicted`. Configurations at
    stage 1-3 (sharded data parallelism) are predicted too, with their peak bytes per rank.
    --memory prints the ZeRO memory model instead (no calibration)."""
    from commlab.costmodel.search import grid_costs as session

    if memory or num_params is not None or precision is not None:
        if not memory:
            raise click.UsageError("--params and --precision go with --memory")
        extra = {**options, "against": against, "hardware": hardware, "calibration": calibration_path, "recalibrate": recalibrate}
        other = [k for k, v in extra.items() if v not in (None, False, ()) and k not in ("model", "model_args", "world_size")]
        if other or spec_file is not None:
            raise click.UsageError(f"--memory takes --params or --model/--model-args, --world-size and --precision "
                                   f"only, got {', '.join(other) or 'a spec file'}")
        click.echo(zero_memory.report(num_params, options.get("model"), options.get("model_args"),
                                      options.get("world_size"), precision))
        return
    begin = time.monotonic()
    preset = None
    if hardware is not None:
        from commlab.costmodel.hardware.presets import load_preset

        try:
            preset = load_preset(hardware)
        except ValueError as err:
            raise click.UsageError(str(err)) from None
    if against is not None and against.exists() and not against.is_dir():
        raise click.UsageError(f"--against {against} is a file: give a measured sweep's results directory (OUT/NAME)")
    if against is not None and not against.is_dir():
        raise click.UsageError(f"--against {against}: no such directory. It is a measured sweep's results: run "
                               f"`commlab sweep` with the same spec first (it writes OUT/NAME), then predict against it")
    plan = _plan(spec_file, options, hardware=hardware)
    measured = None
    if against is not None:
        from commlab.runs.store import read_tables

        try:
            measured = read_tables(against)[2]
        except FileNotFoundError as err:
            raise click.UsageError(f"--against: {err}") from None
    name = plan.name or (spec_file.stem if spec_file else time.strftime("predict-%Y%m%d-%H%M%S"))
    run_dir = Path(plan.out) / name
    if plan.name is None and (against is not None or session.holds_measured(run_dir)):
        # Without --name, a prediction never lands on measured results (the sweep of the same
        # spec writes OUT/<spec name>): it takes a name of its own beside them.
        run_dir = Path(plan.out) / f"{name}-predicted"
    check_writable(run_dir)  # before a calibration that can take a minute
    try:
        session.check_run_dir(run_dir)  # e.g. --name of a measured run: a usage error, not a traceback
        if preset is None:
            entries = session.entries_for(plan.configs, calibration_path=calibration_path, recalibrate=recalibrate, echo=_ECHO)
            _warn_unsteady(entries.values())
            records, meta = session.predict(plan, entries)
        else:  # what-if: nothing of this machine is measured (hardware.py)
            if recalibrate:
                raise click.UsageError("--recalibrate with --hardware: a preset's prediction measures nothing here "
                                       "(its compute is a calibration made on that device, or the model's FLOPs)")
            records, meta = session.predict_on(plan, preset, calibration_path, echo=_ECHO)
    except ValueError as err:
        raise click.UsageError(str(err)) from None
    from commlab.costmodel.search.predict import table, write_prediction

    click.echo(meta["figure_note"])  # what every figure below is: predicted, and from what
    click.echo(table(records))
    write_prediction(run_dir, records, meta)
    _ECHO(f"commlab predict: {len(records)} configuration(s) -> {run_dir} ({time.monotonic() - begin:.1f} s)")
    if draw:
        from commlab.sweep.figures import draw_all

        written = draw_all(run_dir)
        _ECHO(f"figures in {run_dir / 'figures'}: {', '.join(p.name for p in written if p.suffix == '.png')}")
    if measured is not None:
        from commlab.validation import compare
        from commlab.runs.store import read_tables

        both = compare.join(read_tables(run_dir)[2], measured)
        if both.empty:
            raise click.ClickException(f"--against {against}: no configuration in common with the prediction")
        taus = compare.series_taus(both)
        click.echo(compare.report(both, taus))
        from commlab._atomic import write_text

        write_text(run_dir / "comparison.csv", both.to_csv(index=False, float_format="%.9g"))
        write_text(run_dir / "comparison.json", json.dumps(compare.summary(both, taus), indent=1) + "\n")
        paths = compare.draw(both, run_dir / "figures" / "predicted_vs_measured")
        _ECHO(f"comparison: {run_dir / 'comparison.csv'}, {paths[0]}")


def _warn_unsteady(entries) -> None:
    """Say so when a prediction rests on a calibration the machine's load disturbed."""
    from commlab.costmodel.calibration.cache import key_id
    from commlab.costmodel.terms.uncertainty import Steadiness

    for entry in entries:
        if "steadiness" in entry and not entry["steadiness"]["steady"]:
            _ECHO(f"WARNING: calibration {key_id(entry['key'])} was {Steadiness.from_json(entry['steadiness']).describe()}; "
                  "its predictions may be off by more than the validated error. Calibrate again on a quiet "
                  "machine (--recalibrate).")


def _tune(spec_file, calibration_path, recalibrate, as_json, force, stage, memory_gb, optimizer_bytes, **options):
    """Recommend DDP settings by simulation, no sweep: the best torch DDP configuration (torch
    keywords only) and the best commlab one, each with a predicted step time and the interval the
    model's validated error gives; every registered all-reduce algorithm is searched. A calibration
    the machine's load disturbed is said to be unsteady, and then the default is recommended
    unless --force. --stage adds the fastest sharded configuration that fits --memory-gb."""
    from commlab.costmodel.search import grid_costs as session

    stages = tune_text.stages_of(stage, memory_gb)
    plan = _plan(spec_file, {**options, "bucket_mb": None})
    algorithms = session.tune_algorithms()
    try:
        entries = session.entries_for(plan.configs, calibration_path=calibration_path, recalibrate=recalibrate, echo=_ECHO,
                                      algorithms=algorithms, shard=stages not in (None, (0,)))
    except ValueError as err:
        raise click.UsageError(str(err)) from None
    policies = tuple(dict.fromkeys(c.bucket_policy for c in plan.configs))  # a spec's bucket_policy key
    names = tuple(dict.fromkeys(("native", *algorithms)))
    results = [session.tune_entry(entry, algorithms=names, policies=policies, force=force)
               for entry in entries.values()]
    if stages is not None:
        from commlab.costmodel.search.tune_sharded import sharded_answer
        from commlab.costmodel.calibration.cache import key_optimizer
        from commlab.runs.optimizers import state_bytes

        try:
            for entry, r in zip(entries.values(), results):
                # unless given, the state of the optimizer calibrated (--optimizer: plain SGD by default)
                state = state_bytes(key_optimizer(entry["key"])) if optimizer_bytes is None else optimizer_bytes
                r["sharded"] = sharded_answer(entry, stages=stages, algorithms=names, optimizer_bytes=state,
                                              memory_bytes=None if memory_gb is None else memory_gb * 2**30,
                                              force=force)
        except ValueError as err:
            raise click.ClickException(str(err)) from None
    if as_json:
        click.echo(json.dumps(results[0] if len(results) == 1 else results, indent=1))
        return
    for entry, r in zip(entries.values(), results):
        click.echo(tune_text.tune_text(entry, r, force))
        if "sharded" in r:
            click.echo(tune_text.sharded_text(r["sharded"]))


_CTX = {"help_option_names": ["-h", "--help"]}

calibrate = click.Command("calibrate", callback=_calibrate, context_settings=_CTX, help=_calibrate.__doc__,
                          params=[*_sweep_params(_RUN_ONLY | _GRID_ONLY | {"draw"}), _calibration(), _RECAL])
predict = click.Command("predict", callback=_predict, context_settings=_CTX, help=_predict.__doc__, params=[
    *_sweep_params(_RUN_ONLY | _MEASURED), *_refused(_RUN_ONLY | _MEASURED),
    click.Option(["--against"], type=click.Path(file_okay=False, path_type=Path),
                 help="a measured sweep's results directory: print measured, predicted, error, rank order "
                      "(the prediction then goes to OUT/NAME-predicted unless --name is given)"),
    _calibration(), _RECAL, *zero_memory.OPTIONS,
    click.Option(["--hardware"], help="a hardware preset (commlab/costmodel/hardware.yaml): NCCL's model of its network, "
                                      "its device's compute from a calibration made there (--calibration) or the model's FLOPs"),
])
tune = click.Command("tune", callback=_tune, context_settings=_CTX, help=_tune.__doc__, params=[
    # no --algorithm: tune searches every registered one, whatever the calibration cache holds
    # its own --stage (auto or one): the sweep's stage/prefetch/reshard lists are what tune searches
    *_sweep_params(_RUN_ONLY | _GRID_ONLY | {"draw", "algorithm", "stage", "prefetch", "reshard"}), _calibration(), _RECAL,
    *tune_text.OPTIONS,
    click.Option(["--json", "as_json"], is_flag=True,
                 help='print one JSON object: {"torch": {...}, "commlab": {...}, "default_step_s": ..., "steady": ...}'),
    click.Option(["--force"], is_flag=True, help="recommend even when the calibration was unsteady (wider intervals)"),
])

for _command in (calibrate, predict, tune):
    add_old_spelling(_command, "calibration_path", "--profile")
