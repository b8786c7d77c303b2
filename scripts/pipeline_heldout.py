"""The pipeline's step time predicted before any configuration ran, against a later `pipeline bench`.

    commlab pipeline plan --ranks 2 --depth 12 --width 768 --batch 64 -m 2,4,8,16 --balance uniform \\
        --checkpoint never,always --predictions pred.csv                 # profile + comm fit, no config run
    commlab pipeline bench --depth 12 --width 768 --batch 64 -m 2,4,8,16 --balance uniform \\
        --checkpoint never,always --name forward                          # then measure the grid
    python scripts/pipeline_heldout.py pred.csv results/forward [results/reverse ...]

Prints each measured configuration beside its prediction, then the median and worst absolute
error over all of them (commlab.validation.planner.against_bench, errors) and, with several
runs of one grid (forward and in reverse), against the mean of their measurements.
"""

from __future__ import annotations

import csv
import statistics
import sys
from pathlib import Path

from commlab.validation.planner import KEY, against_bench, errors


def main(predictions: str, *run_dirs: str) -> None:
    with open(predictions, newline="") as f:
        predicted = list(csv.DictReader(f))
    rows, measured = [], {}
    for run in run_dirs:
        with open(Path(run) / "summary.csv", newline="") as f:
            summary = list(csv.DictReader(f))
        rows += [{**r, "run": Path(run).name} for r in against_bench(predicted, summary)]
        for r in summary:
            measured.setdefault(tuple(r[k] for k in KEY), []).append(float(r["commlab_s"]))
    print(f"{'run':<10} {'schedule':<12} {'m':>3} {'v':>2} {'checkpoint':<12} {'balance':<12} {'pred ms':>8} {'meas ms':>8} {'error':>7}")
    for r in rows:
        print(f"{r['run']:<10} {r['schedule']:<12} {r['microbatches']:>3} {r['virtual']:>2} {r['checkpoint']:<12} {r['balance']:<12} "
              f"{r['predicted_s'] * 1e3:8.2f} {r['measured_s'] * 1e3:8.2f} {r['error'] * 100:6.1f}%")
    report("every run", rows)
    if len(run_dirs) > 1:
        mean = [{**dict(zip(KEY, key)), "commlab_s": statistics.fmean(times)} for key, times in measured.items()]
        report("mean of the runs", against_bench(predicted, mean))


def report(what: str, rows: list) -> None:
    e = errors(rows)
    w = e["worst"]
    print(f"{what}: {e['configurations']} measured configurations predicted ({e['unmatched']} without a prediction): median "
          f"|error| {e['median_abs'] * 100:.1f}%, worst {e['worst_abs'] * 100:.1f}% ({w['schedule']} m={w['microbatches']} "
          f"{w['checkpoint']})")


if __name__ == "__main__":
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    main(*sys.argv[1:])
