"""The calibration cache, cost tables, contention factors and hardware presets (pure, no processes)."""

import json
import math

import pytest

from commlab.costmodel.calibration import cache as prof
from commlab.costmodel.terms.costs import CollectiveCost, fit_table, solve_contention
from commlab.costmodel.hardware.presets import allreduce_cost, load_preset, preset_names


def entry(**key_over):
    key = prof.make_key(backend="gloo", world_size=2, threads=1, model="mlp", model_args="", batch_per_rank=32)
    key.update(key_over)
    return {"key": key, "created": 1000.0,
            "params": {"nbytes": [4, 4], "ready_order": [1, 0], "signature": "abc"},
            "compute": {"forward_s": .1, "ready_s": [.1, .2], "optimizer_s": .01, "nosync_s": .3,
                        "writeback_s_per_byte": 1e-9, "bucket_fixed_s": 1e-4, "corun": 1.1},
            "contention": {}, "collectives": {"native": fit_table([1, 2, 4], [1.0, 2.0, 4.0])},
            "steadiness": {"steady": True}}


def test_calibration_round_trip_and_lookup(tmp_path):
    path = tmp_path / "p.json"
    e = entry()
    prof.store(path, e)
    assert json.loads(path.read_text())["format"] == prof.FORMAT
    got = prof.lookup(path, e["key"], signature="abc", now=1000.0 + 60)
    assert got["compute"]["corun"] == 1.1
    with pytest.raises(KeyError):
        prof.lookup(path, {**e["key"], "world_size": 4}, now=1060.0)


def test_stale_and_changed_calibrations_are_detected(tmp_path):
    path = tmp_path / "p.json"
    e = entry()
    prof.store(path, e)
    with pytest.raises(prof.StaleCalibration, match="old"):
        prof.lookup(path, e["key"], now=1000.0 + prof.DEFAULT_MAX_AGE_S + 1)
    with pytest.raises(prof.StaleCalibration, match="changed"):
        prof.lookup(path, e["key"], signature="other", now=1001.0)
    del e["steadiness"]  # made before calibration judged its own steadiness: measured again
    prof.store(path, e)
    with pytest.raises(prof.StaleCalibration, match="steadiness"):
        prof.lookup(path, e["key"], now=1001.0)


def test_foreign_or_broken_calibrations_are_errors(tmp_path):
    path = tmp_path / "p.json"
    prof.store(path, entry(machine="elsewhere|cpu|64"))
    here = entry()["key"]
    with pytest.raises(prof.CalibrationError, match="another machine"):
        prof.lookup(path, here)
    path2 = tmp_path / "q.json"
    prof.store(path2, entry(torch="1.0.0"))
    with pytest.raises(prof.CalibrationError, match="torch 1.0.0"):
        prof.lookup(path2, here)
    broken = entry()
    del broken["compute"]["corun"]
    with pytest.raises(prof.CalibrationError, match="compute.corun"):
        prof.store(tmp_path / "r.json", broken)
    (tmp_path / "s.json").write_text("{not json")
    with pytest.raises(prof.CalibrationError, match="not a readable calibration file"):
        prof.lookup(tmp_path / "s.json", here)


def test_collective_table_interpolates_and_keeps_the_line():
    fit = fit_table([4 << 20, 1 << 20, 16 << 20], [0.005, 0.002, 0.017])
    assert fit["sizes"] == [1 << 20, 4 << 20, 16 << 20]  # sorted
    assert len(fit["line_residuals"]) == 3 and fit["r2"] > 0.9
    cost = CollectiveCost(tuple(fit["sizes"]), tuple(fit["seconds"]))
    assert cost(1 << 20) == pytest.approx(0.002)
    assert cost(10 << 20) == pytest.approx(0.005 + 0.012 * 6 / 12)  # linear between 4 and 16 MiB
    assert cost(1 << 10) == pytest.approx(0.002)  # latency-bound below the table: held
    assert cost(32 << 20) == pytest.approx(0.017 + 0.001 * 16)  # last segment's slope above
    line = CollectiveCost.line(1e-3, 1e9)
    assert line(1e9) == pytest.approx(1.001)
    with pytest.raises(ValueError):
        CollectiveCost((2, 1), (1.0, 1.0))


def test_contention_factors_invert_the_fluid_model():
    # compute 1.0 s alone, comm 0.4 s alone; kc = 0.5, km = 0.25 -> comm ends at 0.5 (slowed all
    # its life); compute did 0.5 / 1.5 by then and the rest at full speed: 0.5 + 2/3.
    kc, km = solve_contention(1.0, 0.4, 0.5 + (1 - 0.5 / 1.5), 0.5)
    assert (kc, km) == pytest.approx((0.5, 0.25))
    # the other way round: compute ends first
    kc, km = solve_contention(0.2, 1.0, 0.3, 0.3 + (1 - 0.3 / 2.0))
    assert (kc, km) == pytest.approx((0.5, 1.0))
    assert solve_contention(1.0, 1.0, 0.9, 0.9) == (0.0, 0.0)  # faster together: noise, clipped
    with pytest.raises(ValueError):
        solve_contention(0.0, 1.0, 1.0, 1.0)


def test_hardware_preset_file_missing_a_field(tmp_path):
    path = tmp_path / "mine.yaml"
    path.write_text("mine: {gpus_per_node: 4, nvlink_busbw_gbps: 100}\n")
    with pytest.raises(ValueError, match="missing field"):
        load_preset(str(path))
    with pytest.raises(ValueError, match="unknown preset"):
        load_preset("dgx-z9000")
    assert "dgx-a100-hdr200" in preset_names()
    assert math.isfinite(allreduce_cost(load_preset("dgx-h100-ndr400"), 256)(25 << 20))


def test_kendall_tau_b():
    from commlab.validation.compare import kendall_tau

    assert kendall_tau([1, 2, 3], [10, 20, 30]) == pytest.approx(1.0)
    assert kendall_tau([1, 2, 3], [30, 20, 10]) == pytest.approx(-1.0)
    assert kendall_tau([1, 1, 2], [5, 5, 7]) == pytest.approx(1.0)  # ties on both sides
    assert kendall_tau([1, 2, 3, 4], [1, 3, 2, 4]) == pytest.approx(4 / 6)
    assert math.isnan(kendall_tau([1], [1]))


def test_table_sizes_cover_the_buckets_that_occur():
    from commlab.costmodel.calibration.driver import table_sizes

    assert table_sizes(48 << 20) == [64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 48 << 20]
    small = table_sizes(35_000)
    assert len(small) >= 2 and small[-1] >= 35_000 and small == sorted(set(small))


def test_calibration_for_recalibrates_stale_or_incomplete_entries_and_never_runs_multirank_ddp(tmp_path, monkeypatch):
    """A stale entry (too old) or one lacking an algorithm is measured again, not used; a fresh
    complete one is used as is. (calibrate is replaced by a stub: no process is spawned.)"""
    import time

    from commlab.costmodel.calibration import driver as cal
    from commlab.costmodel.calibration import measure

    workload = cal.Workload("mlp", "depth=2,width=64", 32)
    calls = []

    def fake(w, *, backend, world_size, threads=None, algorithms=("native",), echo=None, **_):
        nbytes, shapes = cal.parameter_sizes(w)
        calls.append(tuple(algorithms))
        key = prof.make_key(backend=backend, world_size=world_size, threads=threads, model=w.model,
                            model_args=w.model_args, batch_per_rank=w.batch_per_rank)
        return {"key": key, "created": time.time(),
                "params": {"nbytes": nbytes, "ready_order": list(range(len(nbytes))),
                           "signature": prof.param_signature(nbytes, shapes)},
                "compute": {f: 0.0 for f in prof.REQUIRED["compute"]}, "contention": {},
                "collectives": {a: {} for a in algorithms}, "steadiness": {"steady": True}}

    monkeypatch.setattr(cal, "calibrate", fake)
    path, kw = tmp_path / "p.json", dict(backend="gloo", world_size=2, threads=1)
    cal.calibration_for(workload, path=path, algorithms=("native",), **kw)
    cal.calibration_for(workload, path=path, algorithms=("native",), **kw)
    assert calls == [("native",)]  # fresh: reused
    cal.calibration_for(workload, path=path, algorithms=("native", "ring"), **kw)
    assert calls[-1] == ("native", "ring")  # lacking an algorithm: recalibrated
    said = []
    cal.calibration_for(workload, path=path, algorithms=("native",), max_age_s=0.0, echo=said.append, **kw)
    assert len(calls) == 3 and "recalibrating" in said[-1]  # stale: recalibrated, and said so
    # the rank side refuses to profile DDP on a group of more than one rank
    monkeypatch.setattr(measure.dist, "get_world_size", lambda group=None: 2)
    with pytest.raises(RuntimeError, match="one-rank"):
        measure._ddp_run({}, None, None, object(), bucket_mb=1.0)


def test_validation_table_takes_worst_cases_over_agreeing_measurements_only():
    import pandas as pd

    from commlab.validation.compare import format_table, workload_table

    w = dict(model="mlp", model_args="depth=2", backend="gloo", world_size=2, batch_per_rank=32)
    both = pd.DataFrame([{**w, "error": e, "shape_error": s, "agreement": a}
                         for e, s, a in [(0.1, 0.02, 0.05), (-0.2, -0.04, 0.08), (0.9, 0.6, 0.5)]])
    taus = pd.DataFrame([{**w, "overlap": True, "tau": 1.0, "resolved": True},
                         {**w, "overlap": False, "tau": -1.0, "resolved": False}])
    row, total = workload_table(both, taus).to_dict("records")
    assert row["configs"] == 3 and row["steady"] == 2
    assert row["abs_worst"] == pytest.approx(0.2) and row["shape_worst"] == pytest.approx(0.04)  # 0.9 disagreed
    assert row["abs_median"] == pytest.approx(0.2) and row["shape_median"] == pytest.approx(0.04)
    assert row["tau_min"] == 1.0 and row["resolved_series"] == "1/2"  # the unresolved -1 is not counted
    assert total["workload"] == "all" and "mlp depth=2 w2" in format_table(workload_table(both, taus))


def test_write_back_is_calibrated_from_ddps_own_span_not_the_exposed_time(monkeypatch):
    """exposed_comm ends when the last all-reduce is done (commlab/ddp/timing.py); the write-back
    comes after it. Solving for the write-back from the exposed time gave ~0 s where DDP's own
    write-back span said 8-25 ms for 48 MiB."""
    from commlab.costmodel.calibration import measure

    spec = {"model": "mlp", "model_kwargs": {"depth": 2, "width": 512}}
    total = sum(p.numel() * 4 for p in measure._fresh_model(spec).parameters())
    runs = {True: dict(buckets=1, exposed_s=0.0005, tail_s=0.0105, write_back_s=0.010),
            False: dict(buckets=5, exposed_s=0.0010, tail_s=0.0125, write_back_s=0.0105)}

    def fake(spec, loss_fn, batch, group, bucket_mb):
        return {"forward_s": 0.1, **runs[bucket_mb > total / 2**20]}

    monkeypatch.setattr(measure, "_ddp_run", fake)
    out = measure._profile_ddp(spec, None, None, None)
    assert out["writeback_s_per_byte"] == pytest.approx(0.010 / total)
    assert out["bucket_fixed_s"] == pytest.approx((0.0125 - 0.0105 - 0.0105 + 0.010) / 4)


def test_a_table_holding_a_zero_time_fits_without_dividing_by_it():
    """Fresh memory is a difference of two timings: under load it can come out 0 at a size."""
    fit = fit_table([1 << 10, 1 << 16, 1 << 20], [0.0, 1e-4, 1e-3])
    assert math.isnan(fit["line_residuals"][0]) and all(math.isfinite(r) for r in fit["line_residuals"][1:])
