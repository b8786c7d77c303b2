"""The tuner's search on hand-made costs: it must find the knob values that are best by construction."""

import pytest

from commlab.predict.lower import DDPSetting, StepCosts
from commlab.predict.tuning import search, step_time

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
