"""The iteration columns: one definition (commlab/ddp/timing.py) for DDP, the sweep and the predictor."""

import math

import pytest

from commlab.ddp.timing import COLUMNS, CpuClock, RawIteration, resolve
from commlab.costmodel.lowering.ddp import DDPSetting, breakdown, simulate_step
from commlab.runs import store
from commlab.runs.grid import build_grid, merge
from tests.support.step_costs import costs


def test_sweep_csv_keeps_every_timing_column_ddp_records(tmp_path):
    # One iteration as DDP's reducer stamps it (CPU clock: perf_counter floats), with an
    # unused-parameter all-reduce and a write-back so that every column is non-zero and distinct.
    raw = RawIteration(start=0.0, forward_end=1.0, end=3.0, buckets=[(64, 2, 1.5, 1.625, 2.5)],
                       backward_end=2.25, unused=(2.5, 2.6875), write_back=[(2.75, 2.875)])
    recorded = resolve(CpuClock(), raw).as_row()
    assert len(set(recorded.values())) == len(recorded) and all(v > 0 for v in recorded.values())
    # Stored as the sweep worker does (commlab/sweep/worker.py measure), written to iterations.csv
    # and read back: a column renamed or dropped on either side loses its value here.
    cfg = build_grid(merge({}, {"iters": 1})).configs[0]
    own = {"accumulate_time": 0.0, "optimizer": 0.25, "step": 3.5}
    store.save_record(tmp_path, {"config": cfg.columns(), "status": "ok", "error": "", "started": 0.0, "ended": 1.0,
                                 "iterations": [{"rank": 0, "iteration": 0, **recorded, **own}], "buckets": []})
    store.assemble(tmp_path)
    row = store.read_tables(tmp_path)[0].iloc[0]
    assert set(recorded) == set(COLUMNS) <= set(row.index)
    for column, value in recorded.items():
        assert math.isclose(row[column], value, rel_tol=1e-8), column
    # Also in DDP's order: the predictor's rows (written in STEP_COLUMNS order) line up with them.
    # Then each parallel axis's seconds, absent from a DDP-only record (NaN) and from the predictor's rows.
    assert store.ITERATION_COLUMNS == ["repetition", "rank", "iteration", *COLUMNS, *own, *store.AXIS_COLUMNS]
    assert row[store.AXIS_COLUMNS].isna().all()


def test_predictor_writes_exactly_the_sweeps_iteration_columns():
    c = costs()
    result, buckets = simulate_step(c, DDPSetting(bucket_cap_mb=1))
    row, _ = breakdown(result, buckets, c)
    assert list(row) == store.STEP_COLUMNS == store.ITERATION_COLUMNS[3:-len(store.AXIS_COLUMNS)]


@pytest.mark.slow
def test_reading_results_and_the_simulator_never_import_torch():
    # store.py takes the columns from commlab/ddp/timing.py, which imports no torch, so that the
    # store, figures, trace and the DDP lowering stay torch-free.
    import subprocess
    import sys

    code = ("import sys, commlab.runs.store, commlab.sweep.figures, commlab.sweep.trace, commlab.costmodel.lowering.ddp; "
            "print('torch' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip() == "False"


def test_every_column_is_documented_in_the_store():
    from commlab.runs import store

    for column in [*store.STEP_COLUMNS, *store.AXIS_COLUMNS, *store.BUCKET_COLUMNS[3:], *store.RUN_COLUMNS, "scaling_efficiency"]:
        assert f"``{column}``" in store.__doc__, column
    assert "smallest world size" in store.__doc__ and "1.0 on a grid whose only world size is 2" in store.__doc__
