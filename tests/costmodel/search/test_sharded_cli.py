"""`commlab predict` and `commlab tune` for sharded data parallelism (ZeRO stages 1-3).

The CLI tests run on a synthetic calibration (tests/support/calibrations.py's, plus reduce-scatter
and all-gather tables) or on nothing at all (--memory): no process is spawned. One test calibrates
the sharded collectives for real: the only spawn here.
"""

import dataclasses
import json

import pytest

import commlab
from commlab.costmodel.calibration import cache as prof
from commlab.costmodel.calibration.driver import default_threads
from commlab.costmodel.terms.costs import fit_table
from commlab.runs.grid import build_grid, merge
from commlab.runs.store import read_tables
from tests.support.calibrations import STEADY, invoke, synthetic_entry

TUNE = ["tune", "--model", "mlp", "--model-args", "depth=2,width=64"]


def sharded_entry(**over):
    tables = {c: {a: fit_table([1 << 10, 1 << 16, 1 << 20], [f * 1e-4, f * 2e-4, f * 1.5e-3])
                  for a, f in (("native", 1.0), ("ring", 1.3))} for c in ("reduce_scatter", "all_gather")}
    return synthetic_entry(sharded_collectives=tables, **over)


@pytest.fixture
def calibration(tmp_path):
    path = tmp_path / "calibration.json"
    prof.store(path, sharded_entry())
    return path


@pytest.fixture
def no_spawn(monkeypatch):
    def refuse(*_a, **_k):
        raise AssertionError("no process may be spawned here")

    monkeypatch.setattr(commlab, "launch", refuse)


def test_memory_prints_the_papers_four_zero_numbers_without_any_process(no_spawn):
    r = invoke("predict", "--memory", "--params", "7.5e9", "--world-size", "64", "--precision", "mixed")
    assert r.exit_code == 0, r.output
    assert r.output.splitlines()[-1].split() == ["64", "120.0", "31.4", "16.6", "1.9"]
    r = invoke("predict", "--memory", "--model", "mlp", "--model-args", "depth=2,width=64", "--world-size", "2,4",
               "--precision", "fp32")
    assert r.exit_code == 0, r.output
    lines = r.output.splitlines()
    assert "8970 trainable parameters" in lines[0] and [ln.split()[0] for ln in lines[2:]] == ["2", "4"]
    assert float(lines[2].split()[4]) == pytest.approx(8970 * 16 / 2 / 1e9, rel=1e-2)  # stage 3 at 2 ranks
    for args, message in ((["--params", "1e9"], "go with --memory"), (["--memory"], "--params N or --model"),
                          (["--memory", "--params", "1", "--model", "mlp"], "not both"),
                          (["--memory", "--params", "1", "--world-size", "0"], "positive"),
                          (["--memory", "--params", "1", "--bucket-mb", "5"], "only, got bucket_mb")):
        r = invoke("predict", *args)
        assert r.exit_code == 2 and message in r.output, r.output


def test_tune_stage_auto_recommends_the_fastest_that_fits_and_says_when_nothing_does(calibration, no_spawn):
    base = json.loads(invoke(*TUNE, "--calibration", str(calibration), "--json").output)
    r = invoke(*TUNE, "--calibration", str(calibration), "--json", "--stage", "auto")
    assert r.exit_code == 0, r.output
    free = json.loads(r.output)
    assert {k: v for k, v in free.items() if k != "sharded"} == base  # the DDP answer is unchanged
    s = free["sharded"]
    assert set(s["by_stage"]) == {"0", "1", "2", "3"} and s["memory_limit_bytes"] is None
    assert s["predicted_step_s"] == min(b["predicted_step_s"] for b in s["by_stage"].values())
    # with Adam's state (8 bytes per parameter) every sharded stage holds less than stage 0 (16
    # bytes per parameter): a limit of 4/5 of stage 0's peak needs a sharded stage
    adam = json.loads(invoke(*TUNE, "--calibration", str(calibration), "--json", "--stage", "auto", "--optimizer-bytes", "8")
                      .output)["sharded"]["by_stage"]
    peaks = {int(k): b["predicted_peak_bytes"] for k, b in adam.items()}
    assert peaks[0] > peaks[1]  # (the fastest at stages 2-3 uses one big bucket: its peak is higher)
    limit_gb = 0.8 * peaks[0] / 2**30
    tight = json.loads(invoke(*TUNE, "--calibration", str(calibration), "--json", "--stage", "auto", "--memory-gb",
                              repr(limit_gb), "--optimizer-bytes", "8").output)["sharded"]
    assert tight["stage"] >= 1 and tight["predicted_peak_bytes"] <= limit_gb * 2**30
    assert tight["predicted_step_s"] >= s["predicted_step_s"]
    assert tight == commlab.tune("mlp", model_args="depth=2,width=64", calibration=calibration, stage="auto",
                                 memory_gb=limit_gb, optimizer_bytes=8)["sharded"]
    r = invoke(*TUNE, "--calibration", str(calibration), "--stage", "auto", "--memory-gb", "1e-7")
    assert r.exit_code == 1 and "nothing fits" in r.output and "smallest predicted peak" in r.output
    only3 = json.loads(invoke(*TUNE, "--calibration", str(calibration), "--json", "--stage", "3").output)["sharded"]
    assert only3["stage"] == 3 and set(only3["by_stage"]) == {"3"}
    text = invoke(*TUNE, "--calibration", str(calibration), "--stage", "auto").output
    assert "ShardedDataParallel" in text or "DistributedDataParallel(model, bucket_cap_mb" in text
    assert "stage 3: step" in text and "fastest that fits" in text
    for args, message in ((["--stage", "5"], "stage must be"), (["--memory-gb", "1"], "needs --stage")):
        r = invoke(*TUNE, "--calibration", str(calibration), *args)
        assert r.exit_code == 2 and message in r.output, r.output
    with pytest.raises(ValueError, match="nothing fits"):
        commlab.tune("mlp", model_args="depth=2,width=64", calibration=calibration, stage=3, memory_gb=1e-7)


def test_a_profile_without_sharded_tables_is_calibrated_again_for_them(tmp_path, monkeypatch):
    from commlab.costmodel.calibration import driver as cal

    calls = []

    def fake(workload, *, sharded=False, **_):
        calls.append(sharded)
        return sharded_entry()

    monkeypatch.setattr(cal, "calibrate", fake)
    path = tmp_path / "cache.json"
    prof.store(path, synthetic_entry(collectives={a: synthetic_entry()["collectives"][a]
                                                  for a in ("native", "ring", "tree", "halving_doubling")}))
    assert invoke(*TUNE, "--calibration", str(path), "--json").exit_code == 0 and calls == []  # DDP needs none
    r = invoke(*TUNE, "--calibration", str(path), "--json", "--stage", "2")
    assert r.exit_code == 0 and calls == [True], r.output
    assert json.loads(r.stdout)["sharded"]["stage"] == 2


def test_predicted_records_of_sharded_configurations_carry_the_sharded_columns(calibration, tmp_path):
    from commlab.costmodel.search import grid_costs as session
    from commlab.costmodel.search.predict import UnpriceableConfig, costs_for_config, table, write_prediction
    from commlab.runs.store import read_tables

    plan = build_grid(merge({}, {"model": "mlp", "model_args": "depth=2,width=64", "bucket_mb": "0.01"}))
    configs = [dataclasses.replace(plan.configs[0], stage=s, prefetch=p, optim="adam")
               for s, p in ((0, 1), (1, 0), (2, 0), (3, 0), (3, 2))]
    entry = next(iter(prof.read_file(calibration).values()))
    records, meta = session.predict(type("Grid", (), {"configs": configs})(), {session.group_key(configs[0]): entry})
    rows = [rec["iterations"][0] for rec in records]
    for row in rows:
        assert {"peak_bytes", "comm_bytes", "exposed_allgather", "exposed_reducescatter"} <= set(row)
    assert rows[0]["exposed_allgather"] == 0 and rows[3]["exposed_allgather"] > 0
    peaks = [r["peak_bytes"] for r in rows]
    # Adam, two buckets, no gather ahead: every stage holds less than DDP's parameters, gradients,
    # bucket copies and whole Adam state (the sweep's peaks on this model at world size 2,
    # 2026-11-27, docs/measurements.md: 221 KB at stage 0, at most 187, 181 and 170 KB at stages
    # 1, 2 and 3); stage 3 holds more when it gathers further ahead.
    assert peaks[0] > max(peaks[1:4]) and peaks[4] >= peaks[3]
    # Plain SGD saves no optimizer state: at prefetch 1 stage 1 holds more than DDP on this model,
    # the rank-major buffers of the all-gathers after the step (both buckets, the whole model)
    # outweighing DDP's bucket copy (measured: 153-170 KB against 124 KB).
    sgd = [dataclasses.replace(c, optim="sgd", prefetch=1) for c in configs[:2]]
    plain = session.predict(type("Grid", (), {"configs": sgd})(), {session.group_key(sgd[0]): entry})[0]
    assert plain[1]["iterations"][0]["peak_bytes"] > plain[0]["iterations"][0]["peak_bytes"]
    assert rows[4]["step"] <= rows[3]["step"] + 1e-12  # prefetch hides gathers
    lines = table(records).splitlines()
    assert lines[0].split()[-5:] == ["buckets", "stage", "prefetch", "peak", "MiB"]
    assert [ln.split()[-3:-1] for ln in lines[1:]] == [["0", "-"], ["1", "-"], ["2", "-"], ["3", "0"], ["3", "2"]]
    write_prediction(tmp_path / "p", records, meta)  # the sweep's files, as for DDP
    runs = read_tables(tmp_path / "p")[2]
    assert len(runs) == len(configs) and (runs["step_median"] > 0).all() and set(runs["source"]) == {"predicted"}
    assert list(runs["peak_bytes"]) == peaks and list(runs["stage"]) == [0, 1, 2, 3, 3]
    bare = synthetic_entry()
    with pytest.raises(UnpriceableConfig, match="reduce-scatter"):
        costs_for_config(bare, configs[2])
    assert costs_for_config(bare, configs[0]).forward_s == bare["compute"]["forward_s"]
    assert meta["source"] == "predicted" and STEADY["steady"]


@pytest.mark.slow
def test_calibration_measures_reduce_scatter_and_all_gather_tables_in_one_launch():
    """The one spawn: a world-size-2 calibration of a small model with the sharded tables."""
    from commlab.costmodel.calibration.driver import Workload, calibrate
    from commlab.costmodel.search.tune_sharded import sharded_answer

    entry = calibrate(Workload("mlp", "depth=2,width=32", 8), backend="gloo", world_size=2, threads=1,
                      algorithms=("native",), reps=1, iters=2, sharded=True)
    tables = entry["sharded_collectives"]
    assert set(tables) == {"reduce_scatter", "all_gather"}
    for collective in tables.values():
        assert {"native", "ring"} <= set(collective)
        assert all(t > 0 for fit in collective.values() for t in fit["seconds"])
        assert len(collective["native"]["sizes"]) >= 2
    # what forward keeps for backward: at least the hidden activations, 8 samples x 32 wide x 4 bytes
    assert entry["compute"]["activation_bytes"] >= 8 * 32 * 4
    # the profile ran beside every rank's own DDP loop: nothing is stretched again
    assert entry["compute"]["profiled_beside_ranks"] == 2
    assert [entry["compute"][p] for p in ("corun", "corun_optimizer", "corun_copy")] == [1.0, 1.0, 1.0]
    answer = sharded_answer(entry, stages=(1, 2, 3), algorithms=("native", "ring"))
    assert answer["stage"] in (1, 2, 3) and answer["predicted_step_s"] > 0


def test_an_unsteady_calibration_gives_the_lowest_stage_that_fits_at_the_defaults_unless_forced(tmp_path, no_spawn):
    path = tmp_path / "unsteady.json"
    unsteady = {**STEADY, "steady": False, "spread": 0.85, "reasons": ["repeated micro-benchmarks spread by 85%"]}
    prof.store(path, sharded_entry(steadiness=unsteady))
    args = [*TUNE, "--calibration", str(path), "--json", "--stage", "auto", "--optimizer-bytes", "8"]
    searched = json.loads(invoke(*args, "--force").output)["sharded"]
    assert searched["chosen_by"] == "search" and not searched["steady"]
    peaks = {int(k): b["predicted_peak_bytes"] for k, b in searched["by_stage"].items()}
    for limit in (None, 0.8 * peaks[0] / 2**30):  # no limit: stage 0 fits; 4/5 of its peak: it does not
        extra = [] if limit is None else ["--memory-gb", repr(limit)]
        r = invoke(*args, *extra)
        assert r.exit_code == 0, r.output
        s = json.loads(r.output)["sharded"]
        fits = [int(k) for k, b in s["by_stage"].items() if b["fits"]]
        assert s["chosen_by"] == "default" and s["stage"] == min(fits)
        want_algorithm = "native" if s["stage"] == 0 else "ring"  # what "auto" runs on Gloo with CPU tensors
        assert s["kwargs"]["algorithm"] == want_algorithm
        assert s == commlab.tune("mlp", model_args="depth=2,width=64", calibration=path, stage="auto",
                                 memory_gb=limit, optimizer_bytes=8)["sharded"]
    assert s["stage"] >= 1 and s["kwargs"].get("prefetch", 1) == 1
    text = invoke(*[a for a in args if a != "--json"]).output
    assert "not a search" in text and "--force" in text


def test_predict_of_a_stage_sweep_with_adam_uses_an_adam_calibration_and_counts_its_state(tmp_path, no_spawn):
    sgd = tmp_path / "sgd.json"
    prof.store(sgd, sharded_entry())
    spec = ["predict", "--model", "mlp", "--model-args", "depth=2,width=64", "--stage", "0,1,2,3", "--bucket-mb", "0.01",
            "--overlap", "on", "--out", str(tmp_path), "--no-figures"]
    # Adam is the stage sweep's default: the cached SGD calibration profiled another step, so it is
    # not used (a calibration would start here)
    with pytest.raises(AssertionError, match="no process may be spawned"):
        invoke(*spec, "--calibration", str(sgd), "--name", "from-sgd")
    adam = tmp_path / "adam.json"
    key = prof.make_key(backend="gloo", world_size=2, threads=default_threads(2), model="mlp",
                        model_args="depth=2,width=64", batch_per_rank=32, optimizer="adam")
    assert key["optimizer"] == "adam" and "-adam-" in prof.key_id(key) and "optimizer" not in sharded_entry()["key"]
    prof.store(adam, sharded_entry(key=key))
    peaks = {}
    for optimizer, path in (("adam", adam), ("sgd", sgd)):
        r = invoke(*spec, "--calibration", str(path), "--name", optimizer, "--optimizer", optimizer)
        assert r.exit_code == 0, r.output
        runs = read_tables(tmp_path / optimizer)[2]
        assert set(runs["optim"]) == {optimizer}
        peaks[optimizer] = dict(zip(runs["stage"], runs["peak_bytes"]))
    psi = sum(sharded_entry()["params"]["nbytes"]) / 4  # fp32 parameters
    # Adam's 8 bytes per parameter: whole at stage 0, halved over the two ranks at stages 1-3; at
    # stage 0 (no activations in this calibration) also its step's three temporaries of the largest
    # parameter (torch's single-tensor Adam, measured: commlab/sharded/memory_model.py), which stages 1-3 hold beside smaller transients of their own
    largest = max(sharded_entry()["params"]["nbytes"])
    assert peaks["adam"][0] - peaks["sgd"][0] == pytest.approx(8 * psi + 3 * largest, abs=1)
    for stage in (1, 2, 3):
        assert peaks["adam"][stage] - peaks["sgd"][stage] == pytest.approx(8 * psi / 2, abs=1)
    assert max(peaks["adam"][1], peaks["adam"][2]) < peaks["adam"][0]  # what sharding the state saves
