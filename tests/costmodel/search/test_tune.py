"""The tuner's search on hand-made costs: it must find the knob values that are best by construction."""

import math

import pytest

from commlab.costmodel.lowering.ddp import DDPSetting, StepCosts
from commlab.costmodel.search.tune import answer, search, step_time, torch_settings
from commlab.costmodel.terms.uncertainty import (
    VALIDATION,
    Steadiness,
    judge,
    overall_spread,
    own_load,
    relative_spread,
    within_noise,
)

MIB = 1 << 20


def costs(alpha: float, per_mib: float, **over) -> StepCosts:
    n = 16  # sixteen 1 MiB parameters, 10 ms of backward each
    base = dict(forward_s=0.05, ready_s=tuple(0.01 * (j + 1) for j in range(n)), ready_order=tuple(reversed(range(n))),
                param_nbytes=(MIB,) * n, optimizer_s=0.01, nosync_s=0.2, writeback_s_per_byte=0.0,
                bucket_fixed_s=0.0, corun=1.0, kc=0.0, km=0.0,
                allreduce=lambda nbytes: alpha + per_mib * nbytes / MIB)
    return StepCosts(**{**base, **over})


def test_large_latency_favours_one_bucket_and_no_latency_favours_small_buckets():
    # Latency 1 s per all-reduce: the fewest buckets win (one bucket holding all 16 MiB).
    rec = search({"native": costs(1.0, 0.001)})
    assert rec.commlab.setting.bucket_cap_mb >= 16 and rec.commlab.setting.first_bucket_mb is None
    assert rec.torch.setting.bucket_cap_mb >= 16
    # No latency, comm as long as compute per MiB: small buckets overlap best.
    rec = search({"native": costs(0.0, 0.01)})
    assert rec.commlab.setting.bucket_cap_mb <= 1.5 and rec.commlab.setting.overlap
    assert rec.commlab.step_s < rec.default.step_s and rec.torch.step_s < rec.default.step_s


def test_the_cheaper_algorithm_is_commlabs_answer_and_torchs_stays_native():
    rec = search({"native": costs(0.0, 0.02), "ring": costs(0.0, 0.005)})
    assert rec.commlab.algorithm == "ring" and rec.torch.algorithm == "native"
    out = answer(rec, None)
    assert set(out) == {"torch", "commlab", "default_step_s", "steady"}
    assert set(out["torch"]["ddp_kwargs"]) <= {"bucket_cap_mb"}
    assert out["commlab"]["commlab_kwargs"]["algorithm"] == "ring"
    assert out["commlab"]["predicted_step_s"] == pytest.approx(step_time(costs(0.0, 0.005), rec.commlab.setting))
    with pytest.raises(ValueError, match="native"):
        search({"ring": costs(0.0, 0.005)})


def test_torchs_answer_is_priced_with_torchs_own_first_bucket():
    """An explicit bucket_cap_mb makes torch's first bucket as large as the cap (torch 2.13
    _BucketCapacityConfig.create); only the default keeps 1 MiB. Where a small first bucket pays,
    commlab's answer uses one and torch's cannot: its price is that of a first bucket equal to the cap."""
    c = costs(0.04, 0.004)  # 40 ms per all-reduce: 8 MB buckets, the last gradients' bucket small
    rec = search({"native": c}, overlaps=(True,))
    assert rec.commlab.setting == DDPSetting(bucket_cap_mb=8.0, first_bucket_mb=1.0)
    assert rec.torch.setting == DDPSetting(bucket_cap_mb=8.0)  # first bucket = cap, overlap, size_cap
    assert rec.torch.step_s == step_time(c, DDPSetting(bucket_cap_mb=8.0))
    assert rec.torch.step_s > step_time(c, DDPSetting(bucket_cap_mb=8.0, first_bucket_mb=1.0)) == rec.commlab.step_s
    assert rec.torch.ddp_kwargs() == {"bucket_cap_mb": 8.0} and rec.default.ddp_kwargs() == {}
    for setting in torch_settings((2.0, 8.0)):
        assert setting.first_bucket_mb is None and setting.overlap and setting.policy == "size_cap"


def test_recommendation_is_never_worse_than_the_default():
    c = costs(0.002, 0.004, kc=0.5, km=0.3)
    rec = search({"native": c})
    assert rec.commlab.step_s <= step_time(c, DDPSetting()) + 1e-12
    assert rec.torch.step_s <= step_time(c, DDPSetting()) + 1e-12
    with pytest.raises(ValueError):
        search({})


STEADY = Steadiness(True, 0.05, 0.1, 1.0, 0.1, 2)
UNSTEADY = Steadiness(False, 0.40, 3.5, 5.0, 3.5, 2, ("load",))


def test_an_unsteady_calibration_recommends_the_default_unless_forced_with_wider_intervals():
    rec = search({"native": costs(0.0, 0.01), "ring": costs(0.0, 0.005)})
    steady, refused, forced = answer(rec, STEADY), answer(rec, UNSTEADY), answer(rec, UNSTEADY, force=True)
    assert steady["steady"] and not refused["steady"] and not forced["steady"]
    assert steady["torch"]["ddp_kwargs"] != {} and steady["commlab"]["commlab_kwargs"]["algorithm"] == "ring"
    for side in ("torch", "commlab"):  # refused: torch's default, priced, in both answers
        assert refused[side]["ddp_kwargs"] == {} and refused[side]["predicted_step_s"] == rec.default.step_s
        assert forced[side]["predicted_step_s"] == steady[side]["predicted_step_s"]
        width = lambda a: a["interval_s"][1] / a["interval_s"][0]  # noqa: E731
        assert width(forced[side]) > width(steady[side])
    assert refused["commlab"]["commlab_kwargs"]["algorithm"] == "native"
    low, high = steady["torch"]["interval_s"]
    p = steady["torch"]["predicted_step_s"]
    # measured = predicted / (1 + error), error within the validated worst either way
    assert low == pytest.approx(p / (1 + VALIDATION.abs_worst)) and high == pytest.approx(p / (1 - VALIDATION.abs_worst))


def test_within_noise_of_the_default_uses_the_validated_shape_error():
    assert within_noise(0.95, 1.0, STEADY)  # 5% gain < 7.9% worst shape error
    assert not within_noise(0.80, 1.0, STEADY)
    assert within_noise(0.80, 1.0, UNSTEADY)  # the spread adds to the noise


@pytest.mark.parametrize("spread, before, after, steady", [
    (0.05, 0.1, 1.5, True),   # quiet: the load after is the calibration's own two threads
    (0.40, 0.1, 1.5, False),  # repeated micro-benchmarks 40% apart
    (0.05, 3.0, 4.0, False),  # another job was running before it started
    (0.05, 0.1, 4.5, False),  # ... or started during it: more than our own threads can explain
])
def test_steadiness_from_spread_and_load(spread, before, after, steady):
    s = judge(spread, before, after, cpus=2, own_threads=2, seconds=40.0)
    assert s.steady is steady and bool(s.reasons) is not steady
    assert Steadiness.from_json(s.as_json()) == s


def test_a_load_average_left_by_a_finished_run_is_not_taken_for_other_jobs():
    """The 1-minute average lags: 2.0 from a run that just ended, nothing running now, decays
    while the calibration's own two threads raise it; other jobs that keep running count."""
    d = math.exp(-10 / 60)
    after = 2.0 * d + 2 * (1 - d)  # the finished run's residue decays, our two threads add
    s = judge(0.05, 2.0, after, cpus=2, own_threads=2, seconds=10.0, running_before=0.0)
    assert s.steady and s.others_load == pytest.approx(0.0, abs=1e-9)
    assert not judge(0.05, 2.0, after, cpus=2, own_threads=2, seconds=10.0).steady  # not knowing what runs now
    busy_after = 4.0 * d + 6 * (1 - d)  # four other threads all along
    s = judge(0.05, 4.0, busy_after, cpus=2, own_threads=2, seconds=10.0, running_before=4.0)
    assert not s.steady and s.others_load == pytest.approx(4.0)


def test_spread_and_own_load_are_what_they_say():
    jitter = 50e-6
    assert relative_spread([1.0, 1.1, 0.9]) == pytest.approx(0.2 - jitter)
    assert relative_spread([1.0]) == 0.0
    # from four samples on, the interquartile range (quantiles' exclusive method): 0.95 to 2.05
    assert relative_spread([1.0, 1.1, 0.9, 1.05, 3.0]) == pytest.approx((1.1 + (3.0 - 1.1) / 2 - 0.95 - jitter) / 1.05)
    assert relative_spread([1.0] * 7 + [5.0]) == 0.0  # one preemption in eight does not count
    assert relative_spread([1e-4, 1.3e-4, 0.9e-4]) == 0.0  # 40 us apart: within a wake-up's jitter
    assert relative_spread([1e-3, 2e-3, 1.5e-3]) == pytest.approx((1e-3 - jitter) / 1.5e-3)
    # each series' spread over sqrt(n): the median's own uncertainty; then the median over series
    assert overall_spread([[1.0, 2.0], [1.0, 1.0], [1.0, 1.1]]) == pytest.approx((0.1 - jitter) / 1.05 / math.sqrt(2))
    assert own_load(2, 60.0) == pytest.approx(2 * (1 - math.exp(-1)))
    with pytest.raises(ValueError):
        judge(0.1, 0.0, 0.0, cpus=0, own_threads=1, seconds=1.0)


def test_the_calibrations_spread_comes_from_every_rank_and_the_ddp_steps():
    from commlab.costmodel.calibration.driver import spread_of

    results = [{"collective_samples": {"native": [[1.0, 1.0, 1.0], [2.0, 2.0, 2.0]]}, "ddp": {"step_samples": [1.0, 1.5]}},
               {"collective_samples": {"native": [[1.0, 1.0, 1.0], [2.0, 2.0, 2.0]]}}]
    assert spread_of(results) == 0.0  # four steady series, one noisy one: the median
    results[1]["collective_samples"]["native"] = [[1.0, 2.0], [1.0, 2.0]]
    # median of 0, 0, 0.4 (the DDP steps), 0.67, 0.67, each over sqrt(2 samples)
    assert spread_of(results) == pytest.approx(0.4 / math.sqrt(2), abs=1e-3)


@pytest.mark.slow
def test_tune_takes_a_module_instance_a_name_and_a_factory(tmp_path, monkeypatch):
    """commlab.tune(nn.Module) calibrates the module itself (its ranks load the saved instance):
    the calibration's parameter bytes are the module's, and a second call finds the cached entry."""
    import json

    import torch
    from torch import nn

    import commlab
    from commlab.costmodel.search import module_store as instance

    monkeypatch.setenv("COMMLAB_MODULE_DIR", str(tmp_path / "modules"))
    net = nn.Sequential(nn.Linear(24, 40), nn.ReLU(), nn.Linear(40, 3))
    calibration = tmp_path / "calibration.json"
    kw = dict(world_size=1, algorithms=("native",), batch_per_rank=4, calibration=calibration)
    rec = commlab.tune(net, **kw)
    assert set(rec["torch"]["ddp_kwargs"]) <= {"bucket_cap_mb"} and rec["commlab"]["predicted_step_s"] > 0
    entries = json.loads(calibration.read_text())["entries"]
    (entry,) = entries.values()
    assert entry["key"]["model"] == instance.FACTORY
    assert sorted(entry["params"]["nbytes"]) == sorted(p.numel() * 4 for p in net.parameters())
    # same shapes, other weights -> same name, so the cached calibration is reused (no new entry)
    twin = nn.Sequential(nn.Linear(24, 40), nn.ReLU(), nn.Linear(40, 3))
    assert instance.as_name(twin) == instance.as_name(net)
    assert commlab.tune(twin, **kw) == rec
    # a package.module:factory string gets its own entry
    commlab.tune("examples.heldout_models:convnet", model_args="channels=4,hidden=16", **kw)
    assert len(json.loads(calibration.read_text())["entries"]) == 2
    with pytest.raises(TypeError, match="nn.Module"):
        commlab.tune(42, **kw)
    with pytest.raises(ValueError, match="no trainable"):
        commlab.tune(nn.ReLU(), **kw)
    with pytest.raises(ValueError, match="sizes of a named model"):
        commlab.tune(net, model_args="depth=2", **kw)
    assert isinstance(instance.load(instance.as_name(net)[1].split("=")[1]), torch.nn.Sequential)


def test_modules_that_differ_only_in_options_or_activations_get_different_names():
    import torch
    from torch import nn

    from commlab.costmodel.search.module_store import digest

    def mlp(act):
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(8, 8), act, nn.Linear(8, 8))

    assert digest(mlp(nn.ReLU())) == digest(mlp(nn.ReLU()))  # stable: a cached calibration is found again
    assert digest(mlp(nn.ReLU())) != digest(mlp(nn.Tanh()))
    assert digest(nn.Conv2d(3, 4, 3, stride=1)) != digest(nn.Conv2d(3, 4, 3, stride=2))


@pytest.mark.slow
def test_torch_answer_check_judges_the_pick_against_the_grid_measured_with_torch_ddp(monkeypatch):
    """The check's arithmetic (pure), then one small launch: every configuration is a torch DDP
    with only the answer's keywords, timed on both ranks (the tuner is a stub: no calibration)."""
    import commlab
    from commlab.validation import torch_answer as torchcheck

    per_rank = [{"default": [1.0, 1.2], "bucket_cap_mb=5": [0.9, 0.9]}, {"default": [1.1, 1.0], "bucket_cap_mb=5": [1.0, 0.8]}]
    assert torchcheck.slowest_rank(per_rank) == {"default": pytest.approx(1.15), "bucket_cap_mb=5": pytest.approx(0.95)}
    verdict = torchcheck.judge({"default": 1.0, "bucket_cap_mb=5": 0.95, "bucket_cap_mb=8": 0.97}, "bucket_cap_mb=8",
                               ["default", "bucket_cap_mb=5"])
    assert verdict["best"] == "bucket_cap_mb=5" and verdict["within"] and verdict["over"] == pytest.approx(0.97 / 0.95 - 1)
    assert torchcheck.label_of({}) == "default"

    answer = {"torch": {"ddp_kwargs": {"bucket_cap_mb": 0.02}, "predicted_step_s": 0.01, "interval_s": [0.008, 0.013]},
              "steady": True}
    monkeypatch.setattr(commlab, "tune", lambda *a, **k: answer)
    out = torchcheck.check("mlp", "depth=2,width=64", grid_mb=[0.01, 1.0], batch_per_rank=8, iters=2, warmup=1,
                           timeout=300.0)
    assert set(out["medians"]) == {"default", "bucket_cap_mb=0.01", "bucket_cap_mb=1", "bucket_cap_mb=0.02"}
    assert all(s > 0 for s in out["medians"].values()) and out["pick"] == "bucket_cap_mb=0.02"
    assert out["best"] != out["pick"]  # the pick is judged against the others
