"""Hybrid sharding (HSDP) in the sharded lowering, the preset's groups and the tuner: no processes.

Costs are written by hand: shard groups of 2 ranks, 2 replicas (world size 4); the all-reduce
across the replicas costs ``across`` seconds per MiB of the buffer it moves.
"""

import dataclasses

import pytest

from commlab.costmodel.hardware import nccl, presets
from commlab.costmodel.lowering.zero import comm_bytes, padded_bytes, sharded_breakdown, simulate_sharded
from commlab.costmodel.lowering.zero_costs import ShardedSetting
from commlab.costmodel.search.tune_sharded import candidates, sharded_answer
from commlab.costmodel.terms.costs import Overheads, fit_table
from commlab.runs.traffic import comm_bytes as sent
from tests.costmodel.lowering.test_zero import MIB, costs
from tests.support.calibrations import synthetic_entry


def hybrid(across=0.02, shard=2, replicas=2):
    return dataclasses.replace(costs(world=shard), replicas=replicas, replicate=lambda n: across * n / MIB,
                               all_reduce=lambda n: 0.05 * n / MIB)


def run(c, **setting):
    s = ShardedSetting(bucket_cap_mb=1, **setting)
    result, buckets = simulate_sharded(c, s)
    return result, buckets, sharded_breakdown(result, buckets, c, s)[0], s


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_each_reduction_is_followed_by_the_replicas_all_reduce_before_the_optimizer(stage):
    result, buckets, row, s = run(hybrid(), stage=stage)
    plain = run(costs(world=2), stage=stage)[2]
    full = padded_bytes(hybrid(), buckets)
    for b in range(len(buckets)):
        reduce, across = result.spans[f"reduce{b}"], result.spans[f"replicate{b}"]
        assert across.start >= reduce.end - 1e-12
        # stage 1 all-reduces the whole bucket across the replicas, stages 2-3 the rank's shard
        moved = full[b] if stage == 1 else full[b] // 2
        assert across.length == pytest.approx(0.02 * moved / MIB)
        assert result.spans["optimizer"].start >= across.end - 1e-12
    # more communication, never a shorter step; the shards (and so the memory) are the shard group's
    assert row["step"] >= plain["step"] - 1e-12 and row["comm"] > plain["comm"]
    assert row["peak_bytes"] == plain["peak_bytes"]
    extra = sent([("all_reduce", f if stage == 1 else f // 2) for f in full], 2)
    assert comm_bytes(hybrid(), s, buckets) == pytest.approx(comm_bytes(costs(world=2), s, buckets) + extra, abs=1)


def test_stages_two_and_three_wait_for_the_previous_reduction_and_its_all_reduce():
    result, buckets, _, _ = run(hybrid(across=0.5), stage=2)
    launches = sorted(range(len(buckets)), key=lambda b: result.spans[f"launch{b}"].start)
    for prev, nxt in zip(launches, launches[1:]):  # one reduction (with its all-reduce) in flight
        assert result.spans[f"launch{nxt}"].start >= result.spans[f"replicate{prev}"].end - 1e-12


def test_a_cheap_cross_replica_all_reduce_makes_hybrid_sharding_faster_than_sharding_over_all():
    # over 4 ranks the collectives cost 1.5 x those over 2 (a longer ring); the replicas' all-reduce
    # of a shard is cheap: hybrid wins on time and loses on memory
    over_all = dataclasses.replace(costs(world=4), reduce_scatter=lambda n: 0.0375 * n / MIB,
                                   all_gather=lambda n: 0.0375 * n / MIB)
    h, a = run(hybrid(across=0.001), stage=3, prefetch=0)[2], run(over_all, stage=3, prefetch=0)[2]
    assert h["step"] < a["step"] and h["peak_bytes"] > a["peak_bytes"]


def test_the_presets_hybrid_groups_follow_the_mesh_and_price_the_replicas_across_nodes():
    net = presets.network(presets.load_preset("dgx-h100-ndr400"))  # 8 GPUs a node
    within, across = nccl.hybrid_groups(net, 64, 8)
    assert (within.size, within.per_node) == (8, 8)  # a node's GPUs
    assert (across.size, across.per_node, across.sharing) == (8, 1, 8)  # one a node, 8 groups share its NICs
    within, across = nccl.hybrid_groups(net, 64, 4)
    assert (across.size, across.per_node, across.sharing) == (16, 2, 4)
    with pytest.raises(ValueError, match="does not divide"):
        nccl.hybrid_groups(net, 64, 6)
    system = presets.system_on(presets.load_preset("dgx-h100-ndr400"), Overheads(0.0, 0.0), 64, shard=8)
    n = 64 << 20
    # the shard group rides NVLink; the replicas' all-reduce crosses the network
    assert system.collective("reduce_scatter", "native", 8)(n) < system.collective("reduce_scatter", "native", 64)(n)
    assert system.collective("replicate_all_reduce", "native", 8)(n) > system.collective("all_reduce", "native", 8)(n)


def hybrid_entry(factor: float):
    """A world-size-4 calibration with shard groups of 2: their collectives cost half those over 4,
    the replicas' all-reduce ``factor`` x the all-reduce over 4."""
    def table(f):
        return fit_table([1 << 10, 1 << 16, 1 << 20], [f * 1e-4, f * 2e-4, f * 1.5e-3])

    names = ("native", "ring")
    e = synthetic_entry(sharded_collectives={c: {a: table(1.0) for a in names} for c in ("reduce_scatter", "all_gather")},
                        hybrid_collectives={"2": {**{c: {a: table(0.5) for a in names}
                                                        for c in ("reduce_scatter", "all_gather", "all_reduce")},
                                                  "replicate_all_reduce": {a: table(factor) for a in names}}})
    e["key"] = {**e["key"], "world_size": 4}
    return e


def test_tune_searches_the_calibrated_shard_groups_and_keeps_the_memory_budget():
    cheap = hybrid_entry(0.05)
    found = candidates(cheap, (3,), optimizer_bytes=8)
    assert {c.shard_group for c in found} == {0, 2}
    free = sharded_answer(cheap, stages=(3,), optimizer_bytes=8)
    assert free["shard_group"] == 2  # faster when the replicas' all-reduce is cheap
    # a budget below every hybrid candidate's peak: sharding over all four ranks
    budget = min(c.peak_bytes for c in found if c.shard_group == 2) - 1
    tight = sharded_answer(cheap, stages=(3,), optimizer_bytes=8, memory_bytes=budget)
    assert "shard_group" not in tight and tight["predicted_peak_bytes"] <= budget
    # an expensive all-reduce across the replicas: no hybrid pick
    assert "shard_group" not in sharded_answer(hybrid_entry(50.0), stages=(3,), optimizer_bytes=8)
