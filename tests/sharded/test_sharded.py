"""commlab's ShardedDataParallel against torch's DDP and torch's fully_shard on Gloo: two spawns.

The rank-side code is in tests/support/sharded_cases.py; the wrapper runs its default
``algorithm="auto"``, commlab's ring on Gloo (the backend's own collectives:
tests/collectives/test_scatter_gather.py). Tolerances: at world size 2 every comparison is exact
(``torch.equal``): a sum of two numbers does not depend on order, the gradients are pre-divided as
torch's DDP does, and the optimizers are element-wise. At world size 3 each ring sums an element in
an order set by its position in the reduced buffer, and commlab's buckets are not torch's, so the
last bits differ: there the parameters are compared to within 1e-6 of each tensor's largest value
and 1e-5 element-wise (Adam divides by the root of a second moment, which turns a last-bit
difference of a near-zero gradient into a larger relative one).
"""

import pytest
import torch
from torch import nn

import commlab
from tests.support import sharded_cases
from commlab.sharded import ShardedDataParallel
from tests.support.sharded_models import Net


@pytest.fixture(scope="module")
def world2():
    return commlab.launch(sharded_cases.run_world2, world_size=2, backend="gloo", timeout=300)


@pytest.fixture(scope="module")
def world3():
    return commlab.launch(sharded_cases.run_world3, world_size=3, backend="gloo", timeout=300)


def _cases(results):
    return [(rank, name, r) for rank, result in enumerate(results) for name, r in result["cases"].items()]


@pytest.mark.slow
def test_world2_same_parameters_as_torch_ddp_exactly(world2):
    # Stages 1-3 x (SGD, Adam, AdamW, split, units, no_sync, frozen, tied, batch norm, weights
    # edited outside the optimizer), and stage 3 x prefetch 0-2 x reshard on/off, with size buckets
    # and with units.
    cases = _cases(world2)
    assert len(cases) == 2 * 42
    for rank, name, r in cases:
        assert r["exact"], (rank, name, r["rel"])


@pytest.mark.slow
def test_world3_same_parameters_as_torch_ddp_within_the_summation_order(world3):
    for rank, name, r in _cases(world3):
        assert r["scaled"] <= 1e-6 and r["rel"] <= 1e-5, (rank, name, r["scaled"], r["rel"])


@pytest.mark.slow
def test_full_optimizer_state_is_torch_ddps_optimizer_state_and_loads(world2, world3):
    for rank, name, r in _cases(world2):
        o = r["optimizer_state"]
        assert o["exact"] and o["groups_equal"] and o["loaded_equal"], (rank, name)
    for rank, name, r in _cases(world3):
        o = r["optimizer_state"]
        assert o["scaled"] <= 1e-6 and o["groups_equal"] and o["loaded_equal"], (rank, name, o["scaled"])


@pytest.mark.slow
def test_same_parameters_as_torch_fully_shard_on_each_layer(world2, world3):
    for result in world2:
        assert result["fully_shard"]["exact"]
    for result in world3:
        assert result["fully_shard"]["scaled"] <= 1e-6 and result["fully_shard"]["rel"] <= 1e-5


@pytest.mark.slow
def test_a_transformer_gets_torch_ddps_parameters(world2):
    for result in world2:
        assert result["transformer"] == dict.fromkeys(["s3-units", "s3-one-bucket", "s3-split", "s2-split"], True)


@pytest.mark.slow
def test_buckets_split_by_size_or_by_unit(world2):
    cases = world2[0]["cases"]
    names = ["scale", "a.weight", "a.bias", "b.weight", "b.bias", "head.weight", "head.bias"]
    assert cases["s2-adam"]["buckets"] == [names]  # 25 MiB: one bucket
    # A 200-byte cap closes a bucket once it reaches 200 bytes, taking the parameters in backward
    # order (DDP's size_cap policy, rebuilt for the order gradients arrive in); listed in forward order.
    assert cases["s2-split"]["buckets"] == [names[:1], names[1:3], names[3:]]
    # Units: the root's own parameter first (forward order), then one bucket per unit.
    assert cases["s2-units"]["buckets"] == [["scale"], names[1:3], names[3:5], names[5:]]
    # Stage 3 shards the frozen b.bias too, in a bucket of its own (gathered, never reduced).
    assert cases["s3-frozen"]["buckets"] == [names[:1], names[1:3], [names[3], *names[5:]], ["b.bias"]]


@pytest.mark.slow
def test_frozen_parameter_stays_replicated_and_untouched(world2):
    for result in world2:
        for stage in (1, 2, 3):
            assert result["cases"][f"s{stage}-frozen"]["frozen_equal"]


def _expected_bytes(memory, stage, world, kind):
    """The bytes the layout gives (fp32, Adam: K = 8): a sharded kind holds the rank's padded
    shard, a replicated one the unpadded parameters; Adam's moments hold the rank's rows only."""
    per_element = {"parameters": 4, "gradients": 4, "optimizer": 8}[kind]
    if kind == "optimizer":
        return per_element * memory["valid"]
    if {"parameters": stage >= 3, "gradients": stage >= 2}[kind]:
        return per_element * (memory["total"] + memory["padding"]) / world
    return per_element * memory["total"]


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.slow
def test_bytes_at_the_end_of_a_step_match_the_zero_model_within_the_padding(world, world2, world3):
    results = world2 if world == 2 else world3
    checked = 0
    for rank, name, r in _cases(results):
        if "sgd" in name or "no_sync" in name and world == 2:
            continue  # SGD's momentum is K = 4: the Adam cases are the ones checked
        if name == "s3-frozen":
            continue  # stage 3 shards the frozen bias too, outside the model's trainable psi: test_frozen.py
        stage, m = int(name[1]), r["memory"]
        measured = dict(zip(("parameters", "gradients", "optimizer"), m["measured"]))
        model = dict(zip(("parameters", "gradients", "optimizer"), m["model"]))
        for kind in measured:
            expected = _expected_bytes(m, stage, world, kind)
            # Adam's step counter is one 4-byte tensor per parameter, outside the model.
            extra = 4 * m["params"] if kind == "optimizer" else 0
            assert measured[kind] == expected + extra, (rank, name, kind, measured[kind], expected)
            # ... and so the model within the padding (each parameter's rows padded to N pieces).
            assert abs(measured[kind] - extra - model[kind]) <= 8 * m["padding"], (name, kind)
        checked += 1
    assert checked >= (12 if world == 3 else 30)


@pytest.mark.slow
def test_stage3_holds_no_gathered_parameters_between_steps(world2, world3):
    for rank, name, r in _cases(world2) + _cases(world3):
        if name.startswith("s3"):
            assert r["memory"]["gathered_now"] == 0 and r["memory_after_zero_grad"][1] == 0, (rank, name)


@pytest.mark.slow
def test_peak_of_gathered_bytes_follows_prefetch_and_reshard(world2):
    # Units: root [scale] 16 B, a 280 B, b 240 B, head 96 B (each parameter's rows padded to a
    # multiple of 2 pieces of ceil(rows / 2) rows, fp32). The root's bucket stays gathered (as fully_shard's root); each unit is
    # freed after its forward.
    cases = world2[0]["cases"]
    assert cases["s3-units-p0-r1"]["memory"]["full_bytes"] == [16, 280, 240, 96]
    peaks = {(p, r): cases[f"s3-units-p{p}-r{r}"]["memory"]["peak_gathered"] for p in (0, 1, 2) for r in (0, 1)}
    assert peaks[(0, 1)] == 16 + 280  # one unit at a time
    assert peaks[(1, 1)] == 16 + 280 + 240  # the unit in use and the next
    assert peaks[(2, 1)] == 16 + 280 + 240 + 96
    assert peaks[(0, 0)] == peaks[(1, 0)] == peaks[(2, 0)] == 632  # nothing freed until backward
    # Stages 1-2 keep the whole replica.
    assert world2[0]["cases"]["s2-units"]["memory"]["peak_gathered"] == 632


@pytest.mark.slow
def test_timings_count_each_collective_of_an_iteration(world2):
    cases = world2[0]["cases"]
    for name, r in cases.items():
        assert r["finite_times"], name
        assert r["timings"][0] == 5, name  # one per synchronised backward
    # Four buckets: stages 1-2 gather each once and reduce each once; the optimizer step launches
    # the first 1 + prefetch (the default 1) all-gathers, each wait in the forward the next.
    assert cases["s1-units"]["timings"][1:] == ([["all_gather", "all_reduce"]], [8])
    assert cases["s2-units"]["timings"][1:] == ([["all_gather", "reduce_scatter"]], [8])
    for stage in (1, 2):
        assert cases[f"s{stage}-units"]["gathers_before_forward"] == 2
        assert cases[f"s{stage}-units"]["memory"]["gathers_in_flight"] == 2
    assert cases["s3-units-p1-r1"]["gathers_before_forward"] == 0
    assert cases["s3-units-p1-r1"]["memory"]["gathers_in_flight"] == 0
    # Stage 3 gathers again in backward every bucket freed after forward (all but the root's).
    assert cases["s3-units-p1-r1"]["timings"][1:] == ([["all_gather", "reduce_scatter"]], [4 + 3 + 4])
    assert cases["s3-units-p1-r0"]["timings"][1:] == ([["all_gather", "reduce_scatter"]], [4 + 4])


@pytest.mark.slow
def test_state_dict_is_the_unsharded_models_and_loads_both_ways(world2, world3):
    for results, stages in ((world2, (1, 2, 3)), (world3, (3,))):
        for result in results:
            for stage in stages:
                s = result["state"][stage]
                assert s["keys"] and s["same_output"] and s["round_trip"] and s["same_output_after_load"], stage
                assert s["bad_keys"].startswith("ValueError") and "missing keys ['a.bias']" in s["bad_keys"]
                assert "unexpected keys ['extra']" in s["bad_keys"]
                assert s["bad_shape"].startswith("ValueError") and "'a.bias'" in s["bad_shape"]


@pytest.mark.slow
def test_optimizer_over_unsharded_parameters_is_refused_at_its_first_step(world2):
    for result in world2:
        errors = result["optimizer"]
        assert errors["unsharded"].startswith("ValueError") and "sharded.parameters()" in errors["unsharded"]
        assert errors["adafactor"].startswith("ValueError") and "not known to be correct" in errors["adafactor"]
        assert errors["unrelated"] == "no error"
        # Parameters no rank uses train as under fully_shard (tests/sharded/test_unused.py).
        assert errors["unused"] == "no error" and errors["unit_alone"] == "no error"
        assert errors["gathered_after_no_grad_forward"] == 0
        assert errors["outside_its_module"].startswith("RuntimeError") and "units=" in errors["outside_its_module"]
        assert errors["collected"] == (True, 1, 0)
        assert errors["module_called_directly"]


@pytest.mark.slow
def test_requires_grad_changed_after_wrapping_is_refused_at_the_next_forward(world2, world3):
    for result in [*world2, *world3]:
        for case, error in result["requires_grad_changed"].items():
            assert error.startswith("ValueError") and "requires_grad" in error, (case, error)
            assert case.split("-")[1] in error and "before wrapping" in error, (case, error)


# --- bad input, refused before any process group is needed ------------------------------------


def _error(**kwargs):
    module = kwargs.pop("module", None) or Net()
    with pytest.raises(ValueError) as info:
        ShardedDataParallel(module, **kwargs)
    return str(info.value)


def test_stage_outside_1_to_3_is_refused():
    assert "commlab.DistributedDataParallel" in _error(stage=0)
    for stage in (4, -1, 1.5, True, "x"):
        assert "stage must be 0 (DDP: nothing sharded), 1 (optimizer state sharded)" in _error(stage=stage)


def test_bad_prefetch_bucket_cap_reshard_and_algorithm_are_refused():
    assert "prefetch" in _error(prefetch=-1)
    assert "prefetch" in _error(prefetch=1.5)
    assert "bucket_cap_mb" in _error(bucket_cap_mb=0)
    assert "reshard_after_forward" in _error(reshard_after_forward="yes")
    for algorithm in ("tree", "carrier-pigeon"):
        message = _error(algorithm=algorithm)
        assert f"algorithm={algorithm!r}" in message and "native, ring, halving_doubling" in message
    assert "all-reduce only" in _error(algorithm="tree")


def test_bad_units_are_refused():
    net = Net()
    assert "overlap" in _error(module=net, units=[net.a, net.b, net.a])
    seq = nn.Sequential(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)), nn.Linear(2, 1))
    assert "overlap" in _error(module=seq, units=[seq[0], seq[0][1]])
    assert "not a submodule" in _error(module=net, units=[nn.Linear(2, 2)])
    assert "the wrapped module itself" in _error(module=net, units=[net])
    assert "pass [module]" in _error(module=net, units=net.a)  # one module, not a list of them
    assert "pass [module]" in _error(module=seq, units=seq[0])  # a Sequential would iterate its children


def test_a_unit_without_trainable_parameters_makes_no_bucket():
    """fully_shard takes a unit with nothing to shard (an activation, a frozen layer); so do units=."""
    from commlab.ddp.policy import make_policy
    from commlab.sharded.buckets import plan_buckets

    policy = make_policy("size_cap", bucket_cap_mb=25)
    relu_net = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
    assert plan_buckets(relu_net, policy, [relu_net[1]]) == plan_buckets(relu_net, policy, [])
    frozen = Net()
    frozen.head.requires_grad_(False)
    plan = plan_buckets(frozen, policy, [frozen.a, frozen.head])
    assert plan == plan_buckets(frozen, policy, [frozen.a])
    assert len(plan.buckets) == 2 and plan.owners[1] == [frozen.a]  # the root's (scale, b), then a's


def test_a_module_on_several_devices_or_without_trainable_parameters_is_refused():
    net = Net()
    net.head.to("meta")
    assert "several devices" in _error(module=net)
    assert "no trainable parameters" in _error(module=nn.Linear(2, 2).requires_grad_(False))


def test_no_process_group_is_a_clear_error():
    assert not torch.distributed.is_initialized()
    with pytest.raises(RuntimeError, match="initialised process group"):
        ShardedDataParallel(Net())
