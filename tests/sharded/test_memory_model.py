"""The ZeRO memory model as a pure function: the paper's four numbers and the bucket terms."""

import pytest

from commlab.sharded.memory_model import bucket_memory, mixed_precision_memory, zero_memory


def test_the_zero_papers_four_numbers():
    # Rajbhandari et al. 2020, figure 1: Psi = 7.5e9, N = 64, mixed-precision Adam (K = 12).
    gb = [round(zero_memory(7.5e9, 64, stage, "mixed").total / 1e9, 1) for stage in range(4)]
    assert gb == [120.0, 31.4, 16.6, 1.9]


def test_each_stage_shards_one_more_kind():
    m = [zero_memory(1000, 4, s, "fp32") for s in range(4)]
    assert (m[0].parameters, m[0].gradients, m[0].optimizer) == (4000, 4000, 8000)
    assert (m[1].parameters, m[1].gradients, m[1].optimizer) == (4000, 4000, 2000)
    assert (m[2].parameters, m[2].gradients, m[2].optimizer) == (4000, 1000, 2000)
    assert (m[3].parameters, m[3].gradients, m[3].optimizer) == (1000, 1000, 2000)
    assert zero_memory(1000, 4, 3, "fp32", optimizer_bytes=4).optimizer == 1000  # SGD momentum
    assert zero_memory(1000, 1, 3, "mixed").total == zero_memory(1000, 1, 0, "mixed").total


def test_bucket_terms():
    # Buckets of 6, 4 and 10 padded elements (8, 4, 9 real), fp32, 2 ranks.
    b = bucket_memory([6, 4, 10], 2, 3, prefetch=1, unpadded_numels=[5, 4, 9])
    # The two largest gathered (the one in use, one ahead); the two largest full gradient buckets.
    assert b.gathered == (10 + 6) * 4 and b.reduce_scatter == (10 + 6) * 4
    # 2 padding elements, half per rank, each sharded as parameter + gradient + Adam state.
    assert b.padding == 1 * (4 + 4 + 8)
    assert bucket_memory([6, 4, 10], 2, 3, prefetch=0).gathered == 40
    assert bucket_memory([6, 4, 10], 2, 3, prefetch=5).gathered == 80
    # Gloo's all-gather stages through a flat copy: each gather in flight holds its bucket twice,
    # the one ahead of the bucket in use (at most the largest) at stage 3.
    assert bucket_memory([6, 4, 10], 2, 3, prefetch=1, staged=True).gathered == (10 + 6 + 10) * 4
    assert bucket_memory([6, 4, 10], 2, 3, prefetch=0, staged=True).gathered == 10 * 4
    b1 = bucket_memory([6, 4, 10], 2, 1, prefetch=1, unpadded_numels=[5, 4, 9])
    # Stage 1: nothing gathered in forward or backward (the replica stays), no reduce-scatter; after
    # the step the rank-major buffers of the 1 + prefetch all-gathers then in flight and, for the
    # backend's all-gather, a shard-sized input copy of each; the replica is unpadded, the Adam
    # state sharded.
    assert (b1.gathered, b1.reduce_scatter, b1.after_step) == (0, 0, (10 + 6 + (10 + 6) // 2) * 4)
    assert bucket_memory([6, 4, 10], 2, 2, prefetch=0, input_copy=False).after_step == 10 * 4
    assert bucket_memory([6, 4, 10], 2, 2, prefetch=0, staged=True).after_step == (10 + 10 + 5) * 4
    assert bucket_memory([6, 4, 10], 2, 3, prefetch=1).after_step == 0  # stage 3 gathers in forward
    assert b1.padding == 1 * 8


def test_bad_arguments():
    with pytest.raises(ValueError, match="precision"):
        zero_memory(10, 2, 1, "bf16")
    with pytest.raises(ValueError, match="stage"):
        zero_memory(10, 2, 4)
    with pytest.raises(ValueError, match="world_size"):
        zero_memory(10, 0, 1)
    with pytest.raises(ValueError, match="prefetch"):
        bucket_memory([4], 2, 3, prefetch=-1)


def test_hybrid_sharding_divides_by_the_shard_group_not_the_world():
    # 8 ranks as 4 replicas of 2-rank shard groups: each rank holds half of every sharded kind.
    hybrid = zero_memory(1000, 8, 3, "fp32", shard=2)
    assert (hybrid.parameters, hybrid.gradients, hybrid.optimizer) == (2000, 2000, 4000)
    assert zero_memory(1000, 8, 2, "fp32", shard=8) == zero_memory(1000, 8, 2, "fp32")
    assert mixed_precision_memory(1000, 8, 3, shard=4).parameters == 1000 * 4 / 4
    # Buckets padded and sharded over the 2-rank shard group, as over a 2-rank world.
    assert bucket_memory([6, 4, 10], 8, 3, prefetch=1, unpadded_numels=[5, 4, 9], shard=2) == bucket_memory(
        [6, 4, 10], 2, 3, prefetch=1, unpadded_numels=[5, 4, 9])
    for bad in (3, 0, 1.5, True):
        with pytest.raises(ValueError, match="shard must be a positive divisor of world_size 8"):
            zero_memory(1000, 8, 3, shard=bad)
