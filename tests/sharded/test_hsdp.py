"""Hybrid sharding (HSDP) on a 2 x 2 (replicate, shard) grid of 4 Gloo ranks: one spawn.

The rank-side code is tests/support/hsdp_cases.py: commlab's ShardedDataParallel with
``Topology.build(dp=4, shard=2)``'s groups at stages 1-3 (the ring, the backend's collectives,
halving-doubling; one bucket and three), torch's DDP on all 4 ranks, and torch's fully_shard on
``init_device_mesh("cpu", (2, 2))``, each 6 steps of SGD with momentum from rank 0's initial
values on every rank's own data.

Tolerance. The sums run in another order than DDP's (DDP sums 4 ranks' gradients in one
all-reduce; HSDP sums pairs within the shard group, then the pair sums across replicas), so the
last bits differ. Measured on 2026-11-27 (torch 2.13, CPU): the largest difference relative to each
tensor's largest value is 7.3e-8 for every configuration against DDP, and the same for torch's
fully_shard HSDP against DDP. The bound, 1e-6, is about 14 times that; the wrong
variants measured in the same spawn are 5 orders above it: without the all-reduce across
replicas 0.23 (one shard group) and 1.8 (the other), with the sum divided by 2 instead of 4 0.49
(both asserted to fail the bound). Against fully_shard's HSDP the parameters are equal bit for
bit: at 2 x 2 each level sums two numbers (the same in either order), and dividing by 4, or by 2
twice, is exact in binary.
"""

import pytest

import commlab
from tests.support import hsdp_cases

BOUND = 1e-6


@pytest.fixture(scope="module")
def grid(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("hsdp-ckpt"))
    return commlab.launch(hsdp_cases.run, path, world_size=4, backend="gloo", timeout=300)


@pytest.mark.slow
def test_hsdp_2x2(grid):
    for rank, result in enumerate(grid):
        # Topology: shard groups are consecutive ranks, replicate groups every 2nd; the groups built
        # are those ranks. Without shard, the data-parallel group shards and nothing replicates.
        first = rank - rank % 2
        assert result["groups"] == (2, [first, first + 1], [rank % 2, rank % 2 + 2], [first, first + 1],
                                    [rank % 2, rank % 2 + 2])
        assert result["plain"] == (4, True, True)
        cases = result["cases"]
        assert len(cases) == 7
        for name, c in cases.items():
            # Torch's DDP on 4 ranks and torch's fully_shard HSDP, within the summation order.
            assert c["scaled"] <= BOUND and c["vs_fully_shard"] == 0.0, (rank, name, c["scaled"])
            assert c["norm"] <= BOUND, (rank, name)  # clip_grad_norm_ is the global norm
            assert c["same_shards_as_replica"], (rank, name)
            assert c["placements"] == {"(Replicate(), Shard(dim=0))"}, name
            # Shards of 1/2 (the shard group), not 1/4: layouts, memory and the model agree.
            assert c["layout_ranks"] == {2}
            assert c["parameter_shards"] == sum(c["shards"]) == sum(c["padded"]) // 2
            assert c["model_parameters"] == 134 * 4 / 2
            # Collectives: all-gathers and shard-group reductions move buckets padded over 2 ranks;
            # the cross-replica all-reduce moves the reduced shard (stages 2-3) or the whole
            # gradient buffer (stage 1), each bucket once, and is timed on its own.
            k = c["collectives"]
            assert set(k["all_gather"]) == set(c["padded"]) and k["ordered_stamps"]
            stage = int(name[1])
            first_level = "all_reduce" if stage == 1 else "reduce_scatter"
            assert k[first_level] == c["padded"]
            assert k["replicate_all_reduce"] == (c["totals"] if stage == 1 else c["shards"])
        assert result["fully_shard"] <= BOUND
        # DCP saves the (Replicate(), Shard(0)) shards and loads them back, or into 4-way shards.
        assert result["checkpoint"] == {"same": True, "resharded": True}
        # The wrong variants this bound must reject.
        assert result["wrong"]["no_replicas"] > 1e3 * BOUND and result["wrong"]["divided_by_2"] > 1e3 * BOUND
        for case in ("overlap", "same"):
            assert result["refused"][case].startswith("ValueError: the shard group and the replicate group share"), case
