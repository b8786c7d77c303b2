"""A bucket policy is one class: one defined and registered in this file only is used by commlab's
DDP (gradients still torch DDP's), priced by the predictor and accepted by a sweep spec."""

import copy

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import commlab
from commlab.costmodel.lowering import ddp as lower
from commlab.costmodel.lowering.ddp import DDPSetting, StepCosts, breakdown, simulate_step
from commlab.costmodel.search.predict import predict_config
from commlab.ddp.assignment import TensorSpec, buckets_from_ready_order, initial_buckets
from commlab.ddp.policy import (
    DEFAULT_POLICY,
    BucketPolicy,
    SizeCapPolicy,
    checked,
    make_policy,
    policy_names,
    register,
)
from commlab.runs.grid import build_grid, merge

MIB = 1 << 20


@register
class Pairs(BucketPolicy):
    """Two parameters per bucket, whatever their sizes: reversed module order, then ready order."""

    name = "test_pairs"

    def initial(self, params, rebuild_follows):
        return _pairs(list(reversed(range(len(params)))))

    def rebuild(self, params, ready_order):
        return _pairs(list(ready_order))


def _pairs(order):
    return [order[i:i + 2] for i in range(0, len(order), 2)]


def _model():
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))


def _rank():
    # Runs on each spawned rank; the policy is registered there when this module is imported.
    torch.manual_seed(0)
    model = _model()
    ours = commlab.DistributedDataParallel(model, bucket_policy="test_pairs")
    theirs = TorchDDP(copy.deepcopy(model))
    layouts, worst = [ours.bucket_indices], 0.0
    gen = torch.Generator().manual_seed(100 + torch.distributed.get_rank())
    for _ in range(3):
        x = torch.randn(4, 8, generator=gen)
        for ddp in (ours, theirs):
            ddp.zero_grad(set_to_none=True)
            ddp(x).pow(2).sum().backward()
        worst = max(worst, max((a.grad - b.grad).abs().max().item()
                               for a, b in zip(ours.parameters(), theirs.parameters())))
        layouts.append(ours.bucket_indices)
    # The policy holds the caps: DDP's torch attributes read them there, a given policy's own.
    held = commlab.DistributedDataParallel(_model(), bucket_policy=SizeCapPolicy(2, 0.5))
    return {"layouts": layouts, "worst": worst, "policy": ours.bucket_policy,
            "caps": (held.bucket_bytes_cap, held.first_bucket_bytes_cap, ours.bucket_bytes_cap, ours.first_bucket_bytes_cap)}


@pytest.mark.slow
def test_ddp_uses_a_policy_registered_in_a_test_file():
    results = commlab.launch(_rank, world_size=2, backend="gloo", timeout=120)
    assert isinstance(results[0]["policy"], Pairs)
    assert results[0]["caps"] == (2 * MIB, MIB // 2, 25 * MIB, MIB)  # the last two: torch's defaults
    for r in results:
        assert r["worst"] <= 1e-6  # the gradients are torch DDP's, whatever the buckets
        assert r["layouts"][0] == [[5, 4], [3, 2], [1, 0]]  # the policy's initial buckets
        rebuilt = r["layouts"][1]
        assert [len(b) for b in rebuilt] == [2, 2, 2] and sorted(i for b in rebuilt for i in b) == list(range(6))
        assert r["layouts"][1:] == [rebuilt] * 3  # rebuilt once, kept
    assert results[0]["layouts"] == results[1]["layouts"]  # rank 0's ready order, broadcast


def _four_params(**over) -> StepCosts:
    base = dict(forward_s=0.2, ready_s=(0.1, 0.2, 0.3, 0.4), ready_order=(3, 2, 1, 0), param_nbytes=(MIB,) * 4,
                optimizer_s=0.03, nosync_s=0.4, writeback_s_per_byte=0.02 / MIB, bucket_fixed_s=0.01, corun=1.0,
                kc=0.0, km=0.0, allreduce=lambda nbytes: 0.05 * nbytes / MIB)
    return StepCosts(**{**base, **over})


def test_the_predictor_prices_the_policy_by_name_or_instance():
    costs = _four_params()
    _, by_name = simulate_step(costs, DDPSetting(policy="test_pairs"))
    _, by_instance = simulate_step(costs, DDPSetting(policy=Pairs()))
    _, default = simulate_step(costs, DDPSetting())
    assert by_name == by_instance == [[3, 2], [1, 0]]
    assert default == [[3], [2, 1, 0]]  # torch's 1 MiB first bucket, then 25 MiB
    result, buckets = simulate_step(costs, DDPSetting(policy="test_pairs"))
    rows = breakdown(result, buckets, costs)[1]
    assert [r["nbytes"] for r in rows] == [2 * MIB, 2 * MIB]
    # bucket 0 launches when parameter 2's gradient is ready: forward .2 + .2 = .4
    assert rows[0]["launched"] == pytest.approx(0.4)


def test_a_sweep_spec_names_the_policy_and_the_prediction_uses_it():
    plan = build_grid(merge({"bucket_policy": "test_pairs,size_cap"}, {"overlap": "on"}))
    assert [c.bucket_policy for c in plan.configs] == ["test_pairs", "size_cap"]
    assert "-test_pairs-" in plan.configs[0].id and "size_cap" not in plan.configs[1].id
    rec = predict_config(plan.configs[0], _four_params())
    assert rec["config"]["bucket_policy"] == "test_pairs" and {b["nbytes"] for b in rec["buckets"]} == {2 * MIB}
    with pytest.raises(ValueError, match="unknown bucket policy 'nope'"):
        build_grid(merge({"bucket_policy": "nope"}, {}))
    with pytest.raises(ValueError, match="unknown bucket policy 'nope'"):
        commlab.DistributedDataParallel(_model(), bucket_policy="nope")  # before any process group is needed


def test_registry_and_the_default_size_cap_policy():
    assert DEFAULT_POLICY == lower.DEFAULT_POLICY == "size_cap" and {"size_cap", "test_pairs"} <= set(policy_names())
    assert isinstance(make_policy(), SizeCapPolicy) and make_policy(p := Pairs()) is p
    assert isinstance(make_policy("tests.ddp.test_policy:Pairs"), Pairs)  # package.module:Class
    with pytest.raises(ValueError, match="already registered"):
        register(type("Other", (BucketPolicy,), {"name": "test_pairs"}))
    specs = [TensorSpec(MIB // 2, torch.float32, torch.device("cpu"))] * 6
    torch_default = make_policy(bucket_cap_mb=None)
    assert torch_default.initial(specs, rebuild_follows=True) == [[0, 1, 2, 3, 4, 5]]  # unlimited first iteration
    assert torch_default.initial(specs, rebuild_follows=False) == initial_buckets(specs, [MIB, 25 * MIB])
    order = [5, 4, 3, 2, 1, 0]
    assert torch_default.rebuild(specs, order) == buckets_from_ready_order(specs, order, MIB, 25 * MIB) == [[5, 4], [3, 2, 1, 0]]
    with pytest.raises(ValueError, match="exactly one"):
        checked([[0, 1], [1]], 2, Pairs())
    # caps given beside a policy object are still checked, though the policy's own caps hold
    with pytest.raises(ValueError, match="bucket_cap_mb must be positive"):
        make_policy(Pairs(), bucket_cap_mb=0)
    assert (Pairs(10).cap, Pairs(10).first_cap, Pairs().first_cap) == (10 * MIB, 10 * MIB, MIB)


def test_the_tuner_searches_the_policies_it_is_given():
    from commlab.costmodel.search.tune import search, step_time

    costs = _four_params()
    rec = search({"native": costs}, grid_mb=(25.0,), overlaps=(True,), first_buckets=(None,), policies=("test_pairs",))
    pairs = step_time(costs, DDPSetting(bucket_cap_mb=25.0, policy="test_pairs"))
    assert pairs < step_time(costs, DDPSetting())  # so the search must pick the policy (the default is a candidate)
    assert rec.commlab.commlab_kwargs()["bucket_policy"] == "test_pairs" and rec.commlab.step_s == pairs
    assert rec.default.step_s == step_time(costs, DDPSetting())  # the baseline stays torch's default
    both = search({"native": costs}, grid_mb=(25.0,), overlaps=(True,), first_buckets=(None,),
                  policies=("size_cap", Pairs()))
    assert both.commlab.step_s == min(rec.commlab.step_s, step_time(costs, DDPSetting(bucket_cap_mb=25.0)))
