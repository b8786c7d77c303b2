"""The composable bucket lowering and the one costs type, on their own (no processes, no calibration)."""

import pytest
import torch

from commlab.costmodel.lowering.buckets import bucket_tasks
from commlab.costmodel.terms.costs import CollectiveCost, Contention, DDPProfile, Overheads, SystemCosts
from commlab.costmodel.lowering.ddp import DDPSetting, breakdown, simulate_step, step_costs
from commlab.sim import Task, simulate

MIB = 1 << 20


def test_bucket_tasks_is_one_allreduce_per_bucket_in_order_after_the_given_tasks():
    tasks = bucket_tasks([4 * MIB, MIB], lambda n: n / MIB * 0.01, after=("B3s1", "W3s1"), channel="dp1",
                         prefix="s1.allreduce")
    assert [(t.name, t.resource, t.deps, t.kind) for t in tasks] == [
        ("s1.allreduce0", "dp1", ("B3s1", "W3s1"), "allreduce"),
        ("s1.allreduce1", "dp1", (), "allreduce"),  # queued behind bucket 0 on the same channel
    ]
    assert [t.duration for t in tasks] == pytest.approx([0.04, 0.01])
    assert [t.meta for t in tasks] == [{"bucket": 0, "nbytes": 4 * MIB}, {"bucket": 1, "nbytes": MIB}]


def test_bucket_tasks_on_several_channels_and_with_launches():
    tasks = bucket_tasks([1, 2, 3], lambda n: 1.0, after=("x",), channel=["a", "b", "a"],
                         launched_by=["l0", "l1", "l2"], host="rank")
    assert [(t.resource, t.deps, t.host) for t in tasks] == [
        ("a", ("x", "l0"), "rank"), ("b", ("x", "l1"), "rank"), ("a", ("l2",), "rank")]
    with pytest.raises(ValueError, match="one name per bucket"):
        bucket_tasks([1, 2], lambda n: 1.0, channel=["a"])
    with pytest.raises(ValueError, match="one task per bucket"):
        bucket_tasks([1, 2], lambda n: 1.0, launched_by=["l0"])


def test_a_stage_s_buckets_attach_after_its_last_backward():
    # How a pipeline lowering composes it: a stage's last backward on its rank, then its buckets.
    stage = [Task("F0", "rank0", 0.1), Task("B0", "rank0", 0.2, ("F0",)), Task("optimizer", "rank0", 0.05, ("dp.allreduce1",))]
    tasks = stage + bucket_tasks([MIB, 2 * MIB], lambda n: 0.1 * n / MIB, after=("B0",), channel="dp0", prefix="dp.allreduce")
    spans = simulate(tasks).spans
    assert (spans["dp.allreduce0"].start, spans["dp.allreduce0"].end) == pytest.approx((0.3, 0.4))
    assert (spans["dp.allreduce1"].start, spans["dp.allreduce1"].end) == pytest.approx((0.4, 0.6))
    assert spans["optimizer"].end == pytest.approx(0.65)


def test_system_costs_and_a_profile_price_a_ddp_step():
    table = CollectiveCost((MIB, 2 * MIB), (0.05, 0.10))
    system = SystemCosts({("allreduce", "ring", 1): table, ("allreduce", "ring", 2): table}, contention={"ring": Contention(kc=0.0, km=0.0)},
                         corun=1.5, overheads=Overheads(bucket_fixed_s=0.01, writeback_s_per_byte=0.02 / MIB))
    profile = DDPProfile(forward_s=0.2, ready_s=(0.1, 0.3), ready_order=(1, 0), param_nbytes=(MIB, MIB),
                         optimizer_s=0.03, nosync_s=0.4)
    one = step_costs(system, profile, "ring", 1)
    assert one.corun == 1.0  # one rank: no co-run stretch
    two = step_costs(system, profile, "ring", 2)
    assert two.corun == 1.5 and two.allreduce is table and two.bucket_fixed_s == 0.01
    result, buckets = simulate_step(step_costs(system, profile.scaled(1.0), "ring", 2), DDPSetting(bucket_cap_mb=1))
    row, _ = breakdown(result, buckets, two)
    # forward .3; grad1 -> .45; launch0 .45-.46, ar0 .46-.51; grad0 .46-.76; launch1 .76-.77,
    # ar1 .77-.82; write-backs .77-.79 and .82-.84 (launches and write-backs are not stretched)
    assert row["total"] == pytest.approx(.84) and row["exposed_comm"] == pytest.approx(.82 - .76)
    with pytest.raises(ValueError, match="no allreduce cost for algorithm 'native' at world size 2"):
        step_costs(system, profile, "native", 2)
    with pytest.raises(ValueError, match="one entry per parameter"):
        DDPProfile(0.1, (0.1,), (0, 1), (1, 1), 0.0, 0.0)


def test_assign_gives_a_stage_its_buckets_from_the_ddp_policy():
    from commlab.costmodel.lowering.buckets import assign
    from commlab.ddp.assignment import TensorSpec, buckets_from_ready_order

    sizes, order = (MIB // 2,) * 4 + (3 * MIB,), (4, 3, 2, 1, 0)
    specs = [TensorSpec(n, torch.float32, torch.device("cpu")) for n in sizes]
    assert assign(sizes, order) == buckets_from_ready_order(specs, order, MIB, 25 * MIB) == [[4], [3, 2, 1, 0]]
    assert assign(sizes, order, bucket_cap_mb=1) == [[4], [3, 2], [1, 0]]
    nbytes = [sum(sizes[i] for i in b) for b in assign(sizes, order, bucket_cap_mb=1)]
    assert [t.meta["nbytes"] for t in bucket_tasks(nbytes, lambda n: 0.0, after=("B",))] == [3 * MIB, MIB, MIB]
