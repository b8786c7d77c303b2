"""A small held-out check: calibrate, then measure and predict configurations calibration never ran.

The workload is a conv net given as ``package.module:factory`` (examples/heldout_models.py), a
model family the predictor was not developed on. Spawns ranks (one calibration, then each
configuration measured forward and in reverse), so it takes minutes on this shared 2-core
machine. Bounds are generous and never on absolute time alone: the shape (what is left after
one common factor per workload) and the order of bucket sizes where the measurement can tell
them apart; the tuner's recommendation is measured too and must not lose badly to the grid.
"""

import json
import math

from commlab.predict.validate import CONVNET, validate_parts


def test_held_out_factory_model_shape_order_and_tune(tmp_path):
    part = {"model": CONVNET, "model_args": "channels=16,hidden=2048", "bucket_mb": "0.5,100", "algorithm": "native",
            "overlap": "both", "iters": 8, "warmup": 2}
    result = validate_parts([part], tmp_path, tmp_path / "profile.json", tuned=(CONVNET,))
    both, taus = result["both"], result["taus"]
    assert len(both) == 4 and (both["predicted_s"] > 0).all()
    # calibration measured its own things, never these configurations
    assert (tmp_path / "profile.json").exists()
    saved = json.loads((tmp_path / "validation.json").read_text())
    (row, total) = saved["table"]
    assert row["workload"].startswith("convnet") and total["workload"] == "all" and row["configs"] == 4
    assert row["shape_median"] <= 0.25, row
    # Worst cases only where the machine measured a configuration consistently (forward and
    # reverse within 10%, the acceptance's rule): on this shared machine the same configuration
    # can differ by 2x minutes apart.
    steady = both[both["agreement"] <= 0.10]
    assert (steady["shape_error"].abs() <= 0.5).all(), steady
    for r in taus.to_dict("records"):
        if r["resolved"] and not math.isnan(r["tau"]):
            assert r["tau"] >= 0.33, r
    (tune,) = saved["tune"]
    assert tune["recommendation"]["ddp_kwargs"]["bucket_cap_mb"] > 0
    assert tune["recommendation"]["ddp_kwargs"]["bucket_cap_mb"] <= 100
    # The acceptance's 5% is for the quiet full run (README); on a shared machine the same
    # configuration measures up to 2x apart, so this only catches a pick that loses badly.
    assert tune["within"] <= 0.5, tune
