"""The iteration columns: one definition (commlab/ddp/timing.py) for DDP, the sweep and the predictor."""

from commlab.ddp.timing import COLUMNS, IterationTiming
from commlab.predict.lower import DDPSetting, breakdown, simulate_step
from commlab.sweep import store
from test_predict_lower import costs


def test_sweep_stores_every_timing_column_ddp_records():
    recorded = list(IterationTiming(1.0, 2.0, 3.0, 0.5, 4.0).as_row())
    assert recorded == COLUMNS and {"write_back", "unused_allreduce", "exposed_comm"} <= set(COLUMNS)
    assert store.ITERATION_COLUMNS == ["repetition", "rank", "iteration", *COLUMNS, "accumulate_time", "optimizer", "step"]


def test_predictor_writes_exactly_the_sweeps_iteration_columns():
    c = costs()
    result, buckets = simulate_step(c, DDPSetting(bucket_cap_mb=1))
    row, _ = breakdown(result, buckets, c)
    assert list(row) == store.STEP_COLUMNS == store.ITERATION_COLUMNS[3:]


def test_reading_results_and_the_simulator_never_import_torch():
    # The columns are written out in store.py so that figures, trace and the DDP lowering stay
    # torch-free; the test above holds them equal to DDP's own.
    import subprocess
    import sys

    code = "import sys, commlab.sweep.figures, commlab.sweep.trace, commlab.predict.lower; print('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip() == "False"
