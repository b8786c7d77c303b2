"""The sweep's optimizer axis: its names and default, the ids of runs made before it, the optimizer
the worker builds, and the stage figure's data (only the worker's test starts processes)."""

import pytest
import torch
from click.testing import CliRunner

import commlab
from commlab.cli import main
from commlab.runs import store
from commlab.runs.config import Config, optimizer_of
from commlab.runs.grid import build_grid, merge
from commlab.runs.optimizers import OPTIMIZERS, build_optimizer, parse_optimizer, state_bytes
from commlab.sweep import figdata, figures, runner


@pytest.mark.parametrize("args, message", [(["--optimizer", "lamb"], "--optimizer: optimizer must be one of sgd, momentum, adam, adamw"),
                                           (["--optimizer", "sgd,"], "--optimizer: empty item"),
                                           (["--stage", "1", "--optimizer", "Adagrad"], "got 'Adagrad'")])
def test_a_bad_optimizer_is_a_usage_error_before_any_process_starts(args, message, tmp_path, monkeypatch):
    monkeypatch.setattr(runner, "measure_config", lambda *a: pytest.fail("a process started"))
    result = CliRunner().invoke(main, ["sweep", *args, "--out", str(tmp_path), "--no-figures"])
    assert result.exit_code == 2 and message in result.output, result.output


def test_adam_by_default_when_a_stage_shards_and_sgd_for_ddp_alone():
    def optimizers(**cli):
        return {c.optim for c in build_grid(merge({}, cli)).configs}

    assert optimizers() == {"sgd"} and optimizers(stage="0") == {"sgd"}
    assert optimizers(stage="0,1,2,3") == {"adam"} and optimizers(stage="2") == {"adam"}  # DDP beside them too
    assert optimizers(stage="0,3", optimizer="sgd") == {"sgd"} and optimizers(optimizer=" Adam ") == {"adam"}
    both = build_grid(merge({"optimizer": ["sgd", "adam"]}, {"stage": "1"})).configs  # a spec file's list
    assert [c.optim for c in both] == ["sgd", "adam"] and len({c.id for c in both}) == 2
    assert "--optimizer" in CliRunner().invoke(main, ["sweep", "--help"]).output


def test_runs_made_before_the_option_keep_their_ids_and_read_as_sgd():
    # ids of a stage sweep measured with plain SGD before the optimizer was an option (commit 4336ec7)
    zero = build_grid(merge({}, {"stage": "0,1,2,3", "prefetch": "0,1", "bucket_mb": "1,25", "overlap": "on",
                                 "iters": 5, "warmup": 1, "optimizer": "sgd"}))
    ids = {c.id for c in zero.configs}
    assert {"mlp-gloo-w2-b1-native-ov-a1-g1-t1-4a7344", "mlp-gloo-w2-b1-native-ov-a1-g1-t1-s1-12868c",
            "mlp-gloo-w2-b25-native-ov-a1-g1-t1-s3-p1-rs-ffcba5"} <= ids
    assert [c.id for c in build_grid(merge({}, {})).configs] == [
        "mlp-gloo-w2-b25-native-ov-a1-g1-t1-f941ca", "mlp-gloo-w2-b25-native-noov-a1-g1-t1-466e64"]
    adam = build_grid(merge({}, {"stage": "1", "iters": 5, "warmup": 1, "bucket_mb": "1"})).configs[0]
    assert "-s1-adam-" in adam.id and adam.id not in ids
    old = {k: v for k, v in zero.configs[0].columns().items() if k != "optim"}
    assert optimizer_of(old) == "sgd" and Config.from_columns(old) == zero.configs[0]
    assert Config.from_columns(adam.columns()) == adam


def test_the_registry_names_the_state_sharding_saves():
    assert set(OPTIMIZERS) == {"sgd", "momentum", "adam", "adamw"} and parse_optimizer("SGD") == "sgd"
    assert [state_bytes(n) for n in ("sgd", "momentum", "adam", "adamw")] == [0.0, 4.0, 8.0, 8.0]
    assert build_optimizer("momentum", [torch.nn.Parameter(torch.ones(1))]).defaults["momentum"] == 0.9
    with pytest.raises(ValueError, match="one of sgd, momentum, adam, adamw"):
        state_bytes("lbfgs")
    w = torch.nn.Parameter(torch.ones(3))
    opt = build_optimizer("adam", [w])
    w.grad = torch.ones(3)
    opt.step()
    # Adam's state: two fp32 moments per parameter, the 8 bytes the memory model counts
    moments = [t for t in opt.state[w].values() if torch.is_tensor(t) and t.shape == w.shape]
    assert isinstance(opt, torch.optim.Adam) and sum(t.numel() * t.element_size() for t in moments) == 8 * w.numel()


def _train_two_steps(stage: int, optimizer: str):
    from commlab.sweep.worker import prepare

    cfg = build_grid(merge({}, {"stage": str(stage), "optimizer": optimizer, "model_args": "depth=2,width=64",
                                "global_batch": 8, "overlap": "on"})).configs[0]
    trainer = prepare(cfg)
    trainer.step()
    trainer.step()
    state = sum(t.numel() * t.element_size() for s in trainer.optimizer.state.values() for t in s.values()
                if torch.is_tensor(t) and t.dim() > 0)
    shards = sum(p.numel() * p.element_size() for p in trainer.ddp.parameters())
    return type(trainer.optimizer).__name__, state, shards


@pytest.mark.slow
def test_the_worker_steps_the_configurations_optimizer():
    for stage, optimizer in ((1, "adam"), (1, "sgd"), (0, "adam")):
        kind, state, shards = commlab.launch(_train_two_steps, stage, optimizer, world_size=2, backend="gloo",
                                             timeout=120)[0]
        assert kind == {"adam": "Adam", "sgd": "SGD"}[optimizer]
        # Adam keeps two moments of what this rank steps (stage 1: its shard); plain SGD nothing
        assert state == (2 * shards if optimizer == "adam" else 0) and shards > 0


def _runs(tmp_path, **cli):
    """A stage grid's results written as the sweep writes them, with made-up timings and peaks."""
    for i, cfg in enumerate(build_grid(merge({}, {"iters": 1, **cli})).configs):
        row = {"rank": 0, "iteration": 0, **{c: 0.01 for c in store.STEP_COLUMNS}}
        measures = {"peak_bytes": (100 - 10 * cfg.stage) * 2**20, "comm_bytes": 1.0, "exposed_allgather": 0.0,
                    "exposed_reducescatter": 0.0}
        store.save_record(tmp_path, {"config": cfg.columns(), "status": "ok", "error": "", "started": i, "ended": i,
                                     "iterations": [row], "buckets": [], "measures": measures})
    store.assemble(tmp_path)
    return store.read_tables(tmp_path)[2]


def test_one_bucket_size_gives_a_bar_per_stage_in_every_panel(tmp_path):
    df = figdata.sharded(_runs(tmp_path, stage="0,1,2,3", bucket_mb="25", optimizer="sgd,adam"))
    assert list(dict.fromkeys(df["panel"])) == ["mlp, gloo, w2, Adam", "mlp, gloo, w2, SGD"]
    for _, part in df.groupby("panel"):
        # one series per stage (DDP with and without overlap), each at its own x position: no
        # panel of single points, no series drawn over another
        assert list(part["series"]) == ["DDP, overlap", "DDP, no overlap", "stage 1", "stage 2", "stage 3"]
        assert list(part["position"]) == [0, 1, 2, 3, 4] and part.groupby("series")["stage"].nunique().eq(1).all()
    fig = figures._sharded(df)
    peaks = fig.axes[1]
    assert [t.get_text() for t in peaks.texts] == ["100.0", "100.0", "90.0", "80.0", "70.0"]
    assert [t.get_text() for t in peaks.get_xticklabels()] == list(df["series"].iloc[:5])
    assert "whiskers" not in fig.axes[0].get_ylabel()  # one iteration: no spread, none promised
    assert "25 MiB buckets" in fig.axes[0].get_title()


def test_a_panel_with_one_stage_is_left_out(tmp_path):
    # DDP with SGD beside stage 3 with Adam: two panels of one bar each compare nothing
    runs = _runs(tmp_path, stage="0", overlap="on")
    more = _runs(tmp_path / "s3", stage="3", optimizer="adam")
    import pandas as pd

    assert figdata.sharded(pd.concat([runs, more], ignore_index=True)).empty
