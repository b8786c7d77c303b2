"""The tuner's search on hand-made costs: it must find the knob values that are best by construction."""

import pytest

from commlab.costmodel.lower import DDPSetting, StepCosts
from commlab.costmodel.tuning import search, step_time

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
    assert rec.setting.bucket_cap_mb >= 16 and rec.setting.first_bucket_mb is None
    # No latency, comm as long as compute per MiB: small buckets overlap best.
    rec = search({"native": costs(0.0, 0.01)})
    assert rec.setting.bucket_cap_mb <= 1.5 and rec.setting.overlap
    assert rec.predicted_step_s < rec.default_step_s


def test_the_cheaper_algorithm_is_chosen_and_json_is_pasteable():
    rec = search({"native": costs(0.0, 0.02), "ring": costs(0.0, 0.005)})
    assert rec.algorithm == "ring"
    out = rec.as_json()
    assert set(out["ddp_kwargs"]) == {"bucket_cap_mb"}
    assert out["commlab_kwargs"]["algorithm"] == "ring"
    assert out["predicted_step_s"] == pytest.approx(step_time(costs(0.0, 0.005), rec.setting))


def test_recommendation_is_never_worse_than_the_default():
    c = costs(0.002, 0.004, kc=0.5, km=0.3)
    rec = search({"native": c})
    assert rec.predicted_step_s <= step_time(c, DDPSetting()) + 1e-12
    with pytest.raises(ValueError):
        search({})


def test_tune_takes_a_module_instance_a_name_and_a_factory(tmp_path, monkeypatch):
    """commlab.tune(nn.Module) calibrates the module itself (its ranks load the saved instance):
    the profile's parameter bytes are the module's, and a second call finds the cached entry."""
    import json

    import torch
    from torch import nn

    import commlab
    from commlab.costmodel import instance

    monkeypatch.setenv("COMMLAB_MODULE_DIR", str(tmp_path / "modules"))
    net = nn.Sequential(nn.Linear(24, 40), nn.ReLU(), nn.Linear(40, 3))
    profile = tmp_path / "profile.json"
    kw = dict(world_size=1, algorithms=("native",), batch_per_rank=4, profile=profile)
    rec = commlab.tune(net, **kw)
    assert set(rec["ddp_kwargs"]) == {"bucket_cap_mb"} and rec["predicted_step_s"] > 0
    entries = json.loads(profile.read_text())["entries"]
    (entry,) = entries.values()
    assert entry["key"]["model"] == instance.FACTORY
    assert sorted(entry["params"]["nbytes"]) == sorted(p.numel() * 4 for p in net.parameters())
    # same shapes, other weights -> same name, so the cached calibration is reused (no new entry)
    twin = nn.Sequential(nn.Linear(24, 40), nn.ReLU(), nn.Linear(40, 3))
    assert instance.as_name(twin) == instance.as_name(net)
    assert commlab.tune(twin, **kw) == rec
    # a package.module:factory string gets its own entry
    commlab.tune("examples.heldout_models:convnet", model_args="channels=4,hidden=16", **kw)
    assert len(json.loads(profile.read_text())["entries"]) == 2
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

    from commlab.costmodel.instance import digest

    def mlp(act):
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(8, 8), act, nn.Linear(8, 8))

    assert digest(mlp(nn.ReLU())) == digest(mlp(nn.ReLU()))  # stable: a cached calibration is found again
    assert digest(mlp(nn.ReLU())) != digest(mlp(nn.Tanh()))
    assert digest(nn.Conv2d(3, 4, 3, stride=1)) != digest(nn.Conv2d(3, 4, 3, stride=2))
