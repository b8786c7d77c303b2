"""Held-out validation of the predictor: calibrate, measure a grid forward and in reverse, compare.

    python -m commlab.predict.validate --out results/predict-validation \\
        --model mlp --model-args depth=8,width=768 --bucket-mb 0.5,2,8,25,100 --algorithm native,ring

Calibration runs first, just before the grid is measured (the machine drifts), and never sees the
grid's configurations. The grid is measured twice, in order and in reverse, and the mean of the
two median step times is what the prediction is judged against; configurations whose two
measurements differ by more than 10% are reported but left out of the worst cases.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

import click
import pandas as pd

from commlab._atomic import write_text
from commlab.predict import compare, session
from commlab.predict.predict import write_prediction
from commlab.sweep import runner, store
from commlab.sweep.spec import build_plan, merge


def measure_twice(plan, out: Path, echo) -> pd.DataFrame:
    """The grid measured forward then in reverse; runs table with the mean step and agreement."""
    tables = []
    for name, configs in (("forward", plan.configs), ("reverse", tuple(reversed(plan.configs)))):
        run_dir = out / f"measured-{name}"
        runner.run(dataclasses.replace(plan, configs=configs), run_dir, resume=False, echo=echo)
        tables.append(store.read_tables(run_dir)[2].set_index("config"))
    a, b = tables
    runs = a.copy()
    runs["step_median"] = (a["step_median"] + b["step_median"].reindex(a.index)) / 2
    runs["agreement"] = (a["step_median"] - b["step_median"].reindex(a.index)).abs() / runs["step_median"]
    # noise: half the spread of the two measurements, or of p10-p90 if that is wider
    half = (a["step_median"] - b["step_median"].reindex(a.index)).abs() / 2
    runs["step_p10"] = runs["step_median"] - half.combine((a["step_p90"] - a["step_p10"]) / 2, max)
    runs["step_p90"] = runs["step_median"] + half.combine((a["step_p90"] - a["step_p10"]) / 2, max)
    return runs.reset_index()


def validate(options: dict[str, Any], out: Path, profile: Path, echo=lambda line: None) -> dict[str, Any]:
    plan = build_plan(merge({}, {**options, "out": str(out), "name": "predicted"}))
    runner.check_plan(plan)
    entries = session.entries_for(plan.configs, profile_path=profile, recalibrate=True, echo=echo)
    measured = measure_twice(plan, out, echo)
    records, meta = session.predict(plan, entries)
    write_prediction(out / "predicted", records, meta)
    both = compare.join(store.read_tables(out / "predicted")[2], measured)
    both = both.merge(measured[["config", "agreement"]], left_on="config", right_on="config", how="left")
    taus = compare.series_taus(both)
    stable = both[both["agreement"] <= 0.10]
    result = {"all": compare.summary(both, taus), "stable": compare.summary(stable, taus) if len(stable) else {},
              "calibration_s": {k[0] + str(k[4]): e.get("calibration_s") for k, e in entries.items()}}
    write_text(out / "validation.json", json.dumps(result, indent=1, default=str) + "\n")
    write_text(out / "validation.csv", both.to_csv(index=False, float_format="%.9g"))
    compare.draw(both, out / "predicted_vs_measured")
    echo(compare.report(both, taus))
    return {"both": both, "taus": taus, **result}


@click.command()
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), default=Path("results/predict-validation"))
@click.option("--profile", type=click.Path(dir_okay=False, path_type=Path), default=None)
@click.option("--model", default="mlp")
@click.option("--model-args", default="depth=8,width=768")
@click.option("--bucket-mb", default="0.5,2,8,25,100")
@click.option("--algorithm", default="native,ring")
@click.option("--world-size", default="2")
@click.option("--overlap", default="both")
@click.option("--global-batch", default=64, help="samples per step over all ranks (48 splits over 2, 3 and 4)")
@click.option("--iters", default=20)
def main(out: Path, profile: Path | None, **options) -> None:
    """Calibrate, then measure and predict a held-out grid (see the module docstring)."""
    validate(options, out, profile or out / "profile.json", echo=lambda line: click.echo(line, err=True))


if __name__ == "__main__":
    sys.exit(main())
