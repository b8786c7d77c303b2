"""Hybrid sharding's calibration tables: the shard groups' collectives and the replicas' all-reduce,
measured with every group at once (one spawn at world size 4), and the sizes they are made for."""

import pytest

import commlab
from commlab.costmodel.calibration.sharded import shard_sizes


def test_shard_sizes_are_the_proper_divisors_a_hybrid_layout_can_use():
    assert shard_sizes(2) == [] and shard_sizes(3) == [] and shard_sizes(4) == [2]
    assert shard_sizes(8) == [2, 4] and shard_sizes(12) == [2, 3, 4, 6]


def _tables():
    import torch.distributed as dist

    from commlab.costmodel.calibration.sharded import time_hybrid

    out = time_hybrid(["native", "ring", "halving_doubling"], [1 << 12, 1 << 16], iters=2)
    return {"rank": dist.get_rank(), "tables": out}


@pytest.mark.slow
def test_hybrid_tables_are_measured_on_every_group_at_once():
    results = commlab.launch(_tables, world_size=4, backend="gloo", timeout=300)
    for r in results:
        assert set(r["tables"]) == {"2"}
        kinds = r["tables"]["2"]
        assert set(kinds) == {"reduce_scatter", "all_gather", "all_reduce", "replicate_all_reduce"}
        for kind, by_algorithm in kinds.items():
            # halving-doubling runs on groups of 2 (a power of two): every algorithm has a table
            assert set(by_algorithm) == {"native", "ring", "halving_doubling"}, (kind, by_algorithm)
            assert all(len(t) == 2 and all(s > 0 for s in t) for t in by_algorithm.values())
