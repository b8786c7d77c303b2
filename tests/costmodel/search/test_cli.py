"""`commlab predict`, `tune` and `calibrate` on a synthetic calibration: files, ids, columns, errors.

No process is spawned: the calibration is written by hand for this machine, so nothing calibrates.
"""

import json
import shutil

import pandas as pd
import pytest

from commlab.costmodel.calibration import cache as prof
from commlab.costmodel.terms.costs import fit_table
from commlab.runs.grid import build_grid, merge
from commlab.runs.store import read_tables, tables
from tests.support.calibrations import STEADY, invoke, synthetic_entry

ARGS = ["--model", "mlp", "--model-args", "depth=2,width=64", "--bucket-mb", "0.01,0.02,1", "--algorithm", "native"]


@pytest.fixture
def calibration(tmp_path):
    path = tmp_path / "calibration.json"
    prof.store(path, synthetic_entry())
    return path


def test_predict_writes_the_sweeps_files_ids_and_columns(tmp_path, calibration):
    r = invoke("predict", *ARGS, "--out", str(tmp_path), "--name", "p", "--calibration", str(calibration))
    assert r.exit_code == 0, r.output
    run_dir = tmp_path / "p"
    iterations, buckets, runs = read_tables(run_dir)
    plan = build_grid(merge({}, {"model": "mlp", "model_args": "depth=2,width=64", "bucket_mb": "0.01,0.02,1"}))
    assert list(runs["config"]) == [c.id for c in plan.configs]  # the measured sweep's ids
    empty = tables([])
    for got, want in zip((iterations, buckets, runs), empty):
        assert list(got.columns) == [want.columns[0], "source", *want.columns[1:]]
        assert set(got["source"]) == {"predicted"}
    assert (runs["status"] == "ok").all() and (runs["step_median"] > 0).all()
    # the printed table: one row per configuration, its step time, exposed comm and bucket count
    lines = r.stdout.splitlines()
    assert "PREDICTED" in lines[0] and lines[1].split()[:2] == ["configuration", "step"]
    for cfg, line in zip(plan.configs, lines[2:]):
        name, step, exposed, count, stage, prefetch, peak = line.split()
        row = runs[runs["config"] == cfg.id].iloc[0]
        assert name == cfg.id and float(step) == pytest.approx(row["step_median"] * 1e3, abs=0.051)
        assert (stage, prefetch) == ("0", "-") and float(peak) > 0
        assert float(exposed) >= 0 and int(count) == buckets[(buckets["config"] == cfg.id) & (buckets["rank"] == 0)]["bucket"].nunique()
    assert len(lines) == 2 + len(plan.configs)
    # per-bucket rows: ready <= launched <= done, and bigger caps give fewer buckets
    assert (buckets["launched"] >= buckets["ready"] - 1e-12).all() and (buckets["done"] > buckets["launched"]).all()
    counts = buckets[buckets["rank"] == 0].groupby("bucket_mb")["bucket"].nunique()
    assert counts[0.01] > counts[1.0] == 1
    assert (run_dir / "figures" / "bucket_size.png").exists()
    assert json.loads((run_dir / "metadata.json").read_text())["source"] == "predicted"
    r = invoke("trace", str(run_dir), "-o", str(tmp_path / "trace.json"))  # the sweep's trace, unchanged
    assert r.exit_code == 0 and json.loads((tmp_path / "trace.json").read_text())


def test_against_a_measurement_reports_errors_shape_and_order(tmp_path, calibration):
    assert invoke("predict", *ARGS, "--out", str(tmp_path), "--name", "p", "--calibration", str(calibration),
                  "--no-figures").exit_code == 0
    # A "measurement" 25% slower than the prediction in every configuration: abs error -20%,
    # shape error 0 (one common factor), and the same order of bucket sizes (tau 1).
    shutil.copytree(tmp_path / "p", tmp_path / "m")
    runs = pd.read_csv(tmp_path / "m" / "runs.csv").drop(columns=["source"])
    for c in ("step_median", "step_p10", "step_p90"):
        runs[c] *= 1.25
    runs.to_csv(tmp_path / "m" / "runs.csv", index=False)
    r = invoke("predict", *ARGS, "--out", str(tmp_path), "--name", "p2", "--calibration", str(calibration),
               "--no-figures", "--against", str(tmp_path / "m"))
    assert r.exit_code == 0, r.output
    summary = json.loads((tmp_path / "p2" / "comparison.json").read_text())
    assert summary["median_abs_error"] == pytest.approx(0.2)
    assert summary["worst_shape_error"] == pytest.approx(0.0, abs=1e-9)
    assert summary["mean_tau"] == pytest.approx(1.0)
    assert "Kendall tau" in r.output and (tmp_path / "p2" / "figures" / "predicted_vs_measured.png").exists()


def test_tune_json_holds_two_answers_torch_keywords_only_in_torchs(calibration):
    r = invoke("tune", "--model", "mlp", "--model-args", "depth=2,width=64", "--calibration", str(calibration), "--json")
    assert r.exit_code == 0, r.output
    out = json.loads(r.output)
    assert set(out) == {"torch", "commlab", "default_step_s", "steady"} and out["steady"] is True
    assert set(out["torch"]) == {"ddp_kwargs", "predicted_step_s", "interval_s"}
    assert set(out["commlab"]) == {"ddp_kwargs", "commlab_kwargs", "predicted_step_s", "interval_s"}
    assert set(out["torch"]["ddp_kwargs"]) <= {"bucket_cap_mb"}
    for a in (out["torch"], out["commlab"]):
        low, high = a["interval_s"]
        assert low < a["predicted_step_s"] < high
        assert a["predicted_step_s"] <= out["default_step_s"] + 1e-12
    assert out["commlab"]["predicted_step_s"] <= out["torch"]["predicted_step_s"] + 1e-12  # it searches more
    assert out["commlab"]["commlab_kwargs"]["algorithm"] == "native"  # the others are slower by construction
    text = invoke("tune", "--model", "mlp", "--model-args", "depth=2,width=64", "--calibration", str(calibration)).output
    assert "torch DDP:" in text and "commlab DDP:" in text and "PREDICTED" in text and "steady" in text


@pytest.mark.parametrize("extra, message", [
    (["--hardware", "dgx-z9000"], "unknown preset"),
    (["--backend", "nccl"], "nccl"),
    (["--model", "nosuchmodel"], "unknown model"),
    (["--bucket-mb", "-1"], "positive"),
])
def test_bad_input_fails_before_anything_runs(tmp_path, calibration, extra, message):
    r = invoke("predict", *ARGS, *extra, "--out", str(tmp_path), "--name", "bad", "--calibration", str(calibration))
    assert r.exit_code == 2 and message in r.output
    assert not (tmp_path / "bad").exists()


def test_broken_or_foreign_profiles_are_errors_not_silently_used(tmp_path):
    broken = synthetic_entry()
    del broken["compute"]["forward_s"]
    path = tmp_path / "broken.json"
    path.write_text(json.dumps({"format": prof.FORMAT, "entries": {prof.key_id(broken["key"]): broken}}))
    r = invoke("predict", *ARGS, "--out", str(tmp_path), "--calibration", str(path))
    assert r.exit_code == 2 and "compute.forward_s" in r.output
    foreign = tmp_path / "foreign.json"
    prof.store(foreign, synthetic_entry(key={**synthetic_entry()["key"], "torch": "0.1"}))
    r = invoke("tune", "--model", "mlp", "--model-args", "depth=2,width=64", "--calibration", str(foreign))
    assert r.exit_code == 2 and "torch 0.1" in r.output


def test_hardware_preset_predicts_zero_stages_on_its_reduce_scatter_and_all_gather(tmp_path):
    """Stages 1-3 on a preset: the sharded lowering over the preset's NCCL collectives."""
    r = invoke("predict", "--model", "mlp", "--model-args", "depth=2,width=64", "--hardware", "dgx-a100-hdr200",
               "--backend", "nccl", "--world-size", "8,16", "--stage", "0,2,3", "--batch-per-rank", "32",
               "--bucket-mb", "25", "--overlap", "on", "--no-figures", "--out", str(tmp_path), "--name", "zero",
               "--calibration", str(tmp_path / "none.json"))
    assert r.exit_code == 0, r.output
    runs = read_tables(tmp_path / "zero")[2].set_index(["stage", "world_size"])
    # stage 3 gathers the parameters twice and reduce-scatters once: 3/2 of stage 2's bytes
    assert runs.loc[(3, 16), "comm_bytes"] == pytest.approx(1.5 * runs.loc[(2, 16), "comm_bytes"], rel=0.01)
    assert runs.loc[(3, 16), "peak_bytes"] < runs.loc[(0, 16), "peak_bytes"]
    # leaving NVLink for the NICs at 16 GPUs costs stage 3's collectives
    assert runs.loc[(3, 16), "step_median"] > runs.loc[(3, 8), "step_median"]


def test_hardware_preset_predicts_scaling_labelled_as_such(tmp_path):
    """Without a calibration from the preset's device: compute from FLOPs, nothing calibrated here.
    The label is the metadata's note, which every figure prints: no figure is drawn (seconds each)."""
    common = ["predict", "--model", "mlp", "--model-args", "depth=2,width=64", "--hardware", "dgx-a100-hdr200",
              "--backend", "nccl", "--world-size", "8,16,64", "--scaling", "weak", "--batch-per-rank", "32",
              "--bucket-mb", "25", "--overlap", "on", "--no-figures", "--out", str(tmp_path),
              "--calibration", str(tmp_path / "none.json")]
    r = invoke(*common, "--name", "hw")
    assert r.exit_code == 0, r.output
    runs = read_tables(tmp_path / "hw")[2]
    assert list(runs["world_size"]) == [8, 16, 64]
    assert runs["step_median"].is_monotonic_increasing  # crossing nodes at 16 costs
    note = json.loads((tmp_path / "hw" / "metadata.json").read_text())["figure_note"]
    assert note.startswith("PREDICTED for hardware preset dgx-a100-hdr200")
    assert "NCCL's tuning model" in note and "FLOPs" in note and "ASSUMED" in note
    assert not (tmp_path / "none.json").exists()  # nothing was calibrated
    # With a calibration made on an A100 (any machine), its measured compute is used instead.
    e = synthetic_entry()
    e["key"] = {**e["key"], "world_size": 1, "backend": "nccl", "machine": "elsewhere|gpu|64", "threads": 1}
    e["compute"] = {**e["compute"], "device_name": "NVIDIA A100-SXM4-80GB", "forward_s": 5.0}
    prof.store(tmp_path / "a100.json", e)
    r = invoke(*common[:-1], str(tmp_path / "a100.json"), "--name", "hw2")
    assert r.exit_code == 0, r.output
    note = json.loads((tmp_path / "hw2" / "metadata.json").read_text())["figure_note"]
    assert "compute measured on NVIDIA A100-SXM4-80GB" in note
    assert (read_tables(tmp_path / "hw2")[2]["step_median"] > 5.0).all()  # the calibration's 5 s forward
    r = invoke(*common, "--name", "hw3", "--recalibrate")
    assert r.exit_code == 2 and "measures nothing here" in r.output
    r = invoke(*[a if a != "nccl" else "gloo" for a in common], "--name", "hw4")
    assert r.exit_code == 2 and "--backend nccl" in r.output


def test_commlab_tune_from_python_answers_as_the_cli(calibration):
    import commlab

    out = commlab.tune("mlp", model_args="depth=2,width=64", calibration=calibration)
    r = invoke("tune", "--model", "mlp", "--model-args", "depth=2,width=64", "--calibration", str(calibration), "--json")
    assert json.loads(r.output) == out
    unsteady = synthetic_entry(steadiness={**STEADY, "steady": False, "spread": 0.4, "reasons": ["spread"]})
    prof.store(calibration, unsteady)
    out = commlab.tune("mlp", model_args="depth=2,width=64", calibration=calibration)
    r = invoke("tune", "--model", "mlp", "--model-args", "depth=2,width=64", "--calibration", str(calibration), "--json")
    assert json.loads(r.output) == out and out["steady"] is False
    assert out["torch"]["ddp_kwargs"] == {} and out["torch"]["predicted_step_s"] == out["default_step_s"]
    r = invoke("predict", *ARGS, "--calibration", str(calibration), "--no-figures", "--out", str(calibration.parent), "--name", "u")
    assert r.exit_code == 0 and "WARNING: calibration" in r.output and "UNSTEADY" in r.output
    forced = commlab.tune("mlp", model_args="depth=2,width=64", calibration=calibration, force=True)
    r = invoke("tune", "--model", "mlp", "--model-args", "depth=2,width=64", "--calibration", str(calibration), "--json",
               "--force")
    assert json.loads(r.output) == forced and forced["torch"]["ddp_kwargs"] != {}
    text = invoke("tune", "--model", "mlp", "--model-args", "depth=2,width=64", "--calibration", str(calibration)).output
    assert "UNSTEADY" in text and "NO RECOMMENDATION" in text
    with pytest.raises(TypeError, match="package.module:factory"):
        commlab.tune(object())
    with pytest.raises(ValueError, match="unknown model"):
        commlab.tune("nosuchmodel", calibration=calibration)


def test_the_old_spelling_profile_still_works_with_a_warning(calibration):
    import commlab
    from commlab.cli import validate

    tune = ["tune", "--model", "mlp", "--model-args", "depth=2,width=64", "--json"]
    new = invoke(*tune, "--calibration", str(calibration))
    old = invoke(*tune, "--profile", str(calibration))
    assert old.exit_code == 0 and json.loads(old.stdout) == json.loads(new.stdout)
    assert "warning: --profile is deprecated and goes in a later release: use --calibration" in old.output
    assert "deprecated" not in new.output
    both = invoke(*tune, "--calibration", str(calibration), "--profile", str(calibration))
    assert both.exit_code == 2 and "give --calibration only" in both.output
    for command in ("calibrate", "predict", "tune"):
        text = invoke(command, "--help").output
        assert "--calibration" in text and "--profile" not in text, command
    r = invoke("calibrate", "--model", "mlp", "--model-args", "depth=2,width=64", "--profile", str(calibration))
    assert r.exit_code == 0 and "calibrating" not in r.output  # the old spelling found the same file
    for command in (validate.ddp, validate.sharded, validate.torch_answer):
        assert [p.opts for p in command.params if p.hidden] == [["--profile"]], command.name
    with pytest.warns(FutureWarning, match=r"commlab.tune\(profile=...\) is deprecated.*use calibration="):
        assert commlab.tune("mlp", model_args="depth=2,width=64", profile=calibration) == json.loads(new.stdout)
    with pytest.warns(FutureWarning), pytest.raises(ValueError, match="give calibration= only"):
        commlab.tune("mlp", profile=calibration, calibration=calibration)


def test_calibrate_reuses_a_fresh_calibration_and_reports_its_terms(calibration):
    r = invoke("calibrate", "--model", "mlp", "--model-args", "depth=2,width=64", "--calibration", str(calibration))
    assert r.exit_code == 0, r.output
    assert "calibrating" not in r.output  # fresh and complete: nothing measured
    assert "native: alpha" in r.output and "kc 0.50" in r.output


def test_predicting_over_a_measured_run_is_a_usage_error(tmp_path, calibration):
    measured = tmp_path / "measured"
    (measured / "configs").mkdir(parents=True)
    (measured / "configs" / "x.json").write_text("{}")
    (measured / "metadata.json").write_text('{"source": "measured"}')
    r = invoke("predict", *ARGS, "--out", str(tmp_path), "--name", "measured", "--calibration", str(calibration))
    assert r.exit_code == 2 and "holds measured results" in r.output
    assert (measured / "configs" / "x.json").read_text() == "{}"


def test_the_documented_against_command_works_before_and_after_the_sweep(tmp_path, calibration):
    spec = tmp_path / "bucket_size.yaml"
    spec.write_text("model: mlp\nmodel_args: depth=2,width=64\nbucket_mb: 0.01,1\nalgorithm: native\n")
    measured = tmp_path / "bucket_size"
    common = [str(spec), "--out", str(tmp_path), "--calibration", str(calibration), "--no-figures", "--against", str(measured)]
    r = invoke("predict", *common)  # before the sweep: say what to do, create nothing
    assert r.exit_code == 2 and "no such directory" in r.output and "commlab sweep" in r.output
    assert not measured.exists() and not (tmp_path / "bucket_size-predicted").exists()
    # The sweep's results (a prediction relabelled as a measurement stands in for one).
    assert invoke("predict", str(spec), "--out", str(tmp_path), "--calibration", str(calibration), "--no-figures").exit_code == 0
    meta = json.loads((measured / "metadata.json").read_text())
    (measured / "metadata.json").write_text(json.dumps({**meta, "source": "measured"}))
    r = invoke("predict", *common)
    assert r.exit_code == 0, r.output
    assert json.loads((tmp_path / "bucket_size-predicted" / "comparison.json").read_text())["median_abs_error"] == pytest.approx(0.0)
    assert json.loads((measured / "metadata.json").read_text())["source"] == "measured"  # untouched
    # Without --against, a spec whose default directory holds measured results predicts beside it too.
    r = invoke("predict", str(spec), "--out", str(tmp_path), "--calibration", str(calibration), "--no-figures")
    assert r.exit_code == 0 and "bucket_size-predicted" in r.output


@pytest.mark.parametrize("option", [["--resume"], ["--force"], ["--launcher", "torchrun"], ["--timeout", "5"],
                                    ["--nnodes", "2"], ["--iters", "5"], ["--repeat", "3"]])
def test_predict_refuses_the_options_of_a_run(tmp_path, calibration, option):
    r = invoke("predict", *ARGS, *option, "--out", str(tmp_path), "--name", "x", "--calibration", str(calibration))
    assert r.exit_code == 2 and f"{option[0]} is an option of `commlab sweep`" in r.output
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("command", ["tune", "calibrate"])
def test_tune_and_calibrate_offer_no_sweep_run_options(command):
    r = invoke(command, "--help")
    assert r.exit_code == 0 and "--model" in r.output
    for word in ("--resume", "--repeat", "--launcher"):
        assert word not in r.output, word
    # tune's --force is its own (recommend from an unsteady calibration), not the sweep's
    assert ("--force" in r.output) == (command == "tune")
    assert ("--algorithm" in r.output) == (command == "calibrate")  # tune searches them all


def test_comparison_legend_names_what_differs_in_words():
    from commlab.validation.compare import series_label

    values = {"model": "mlp", "model_args": "", "world_size": 4, "algorithm": "ring", "overlap": False}
    assert series_label(values, ["world_size", "overlap"]) == "world 4, overlap off"
    assert series_label(values, ["model", "model_args", "algorithm"]) == "mlp, default sizes, ring"
    assert series_label(values, []) == "all configurations"


def test_tune_answers_the_same_from_an_empty_cache_and_a_warm_one(tmp_path, monkeypatch):
    """Every registered algorithm is calibrated and searched, whatever the cache held before
    (calibrate is replaced by the synthetic entry: no process is spawned)."""
    from commlab.collectives import algorithm_names
    from commlab.costmodel.calibration import driver as cal

    calls = []

    def fake(workload, *, algorithms=(), **_):
        calls.append(set(algorithms))
        return synthetic_entry()

    monkeypatch.setattr(cal, "calibrate", fake)
    path = tmp_path / "cache.json"
    args = ["tune", "--model", "mlp", "--model-args", "depth=2,width=64", "--calibration", str(path), "--json"]
    cold = invoke(*args)
    warm = invoke(*args)
    assert cold.exit_code == warm.exit_code == 0, cold.output
    assert json.loads(cold.stdout) == json.loads(warm.stdout)
    assert calls == [set(algorithm_names())]  # calibrated once, for every algorithm; then the cache
    # A cache holding only what a prediction needed (native) is completed, not searched as it is ...
    prof.store(path, synthetic_entry(collectives={"native": synthetic_entry()["collectives"]["native"]}))
    assert json.loads(invoke(*args).stdout) == json.loads(cold.stdout) and len(calls) == 2
    # ... and one holding more (an algorithm no longer registered, faster than all) changes nothing.
    more = synthetic_entry()
    more["collectives"]["gone"] = fit_table([1 << 10, 1 << 20], [1e-6, 2e-6])
    prof.store(path, more)
    assert json.loads(invoke(*args).stdout) == json.loads(cold.stdout) and len(calls) == 2
