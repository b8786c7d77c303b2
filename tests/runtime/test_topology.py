"""The tp x pp x dp mesh and its validation, without processes (its groups: tests/pipeline/test_hybrid.py
and tests/pipeline/test_three_d.py)."""

import pytest

import commlab
from commlab.runtime.topology import Topology, check_dims, check_shard, coordinates, grid, hybrid_groups, mesh


def test_mesh_is_arange_view_dp_pp_tp():
    # torch's init_device_mesh order: dp outermost, tp innermost (tensor groups are consecutive ranks)
    assert mesh(2, 2, 2) == [[[0, 1], [2, 3]], [[4, 5], [6, 7]]]
    assert mesh(2, 1, 3) == [[[0, 1]], [[2, 3]], [[4, 5]]]
    for rank in range(24):
        r, s, t = coordinates(rank, 2, 3, 4)
        assert mesh(2, 3, 4)[r][s][t] == rank


def test_pp_by_dp_grid_in_the_same_order():
    # grid[stage][replica]: each replica's pipeline is consecutive ranks (tp = 1 is the innermost axis)
    assert grid(2, 3) == [[0, 2, 4], [1, 3, 5]]
    assert grid(1, 4) == [[0, 1, 2, 3]] and grid(4, 1) == [[0], [1], [2], [3]]


def test_coordinates_and_peer_ranks():
    t = Topology(pp=2, dp=3, rank=4)  # the 2-D form: tp = 1
    assert (t.world_size, t.stage, t.replica, t.tp_rank) == (6, 0, 2, 0)
    assert t.pp_ranks == [4, 5] and t.dp_ranks == [0, 2, 4] and t.tp_ranks == [4]
    t = Topology(pp=2, dp=2, rank=6, tp=2)
    assert (t.world_size, t.replica, t.stage, t.tp_rank) == (8, 1, 1, 0)
    assert t.tp_ranks == [6, 7] and t.pp_ranks == [4, 6] and t.dp_ranks == [2, 6]
    assert commlab.Topology is Topology


def test_dp_defaults_to_the_rest_of_the_world():
    assert check_dims(8, tp=2, pp=2) == (2, 2, 2)
    assert check_dims(4, tp=2) == (2, 1, 2)
    assert check_dims(4, tp=2, pp=2, dp=1) == (2, 2, 1)


def test_bad_dimensions_are_value_errors():
    with pytest.raises(ValueError, match=r"tp x pp x dp = 2 x 2 x 1 = 4, but the world has 8 ranks"):
        check_dims(8, tp=2, pp=2, dp=1)
    with pytest.raises(ValueError, match="tp x pp = 3 x 1 = 3 does not divide the world's 8 ranks"):
        check_dims(8, tp=3)
    with pytest.raises(ValueError, match="tp must be a positive integer"):
        check_dims(8, tp=0)
    with pytest.raises(ValueError, match="pp must be a positive integer"):
        Topology(pp=0, dp=2, rank=0)
    with pytest.raises(ValueError, match="dp must be a positive integer"):
        grid(2, 1.5)
    with pytest.raises(ValueError, match=r"outside a 1 x 2 x 2 \(tp x pp x dp\) mesh"):
        Topology(pp=2, dp=2, rank=4)
    with pytest.raises(RuntimeError, match="initialised process group"):
        Topology.build(2, 2)
    with pytest.raises(RuntimeError, match="initialised process group"):
        Topology.build(tp=2, pp=2)


def test_hybrid_groups_are_rows_and_columns_of_replicate_by_shard():
    # dp ranks viewed as (replicate, shard), shard innermost: shard groups consecutive
    assert hybrid_groups([0, 1, 2, 3], 2) == ([[0, 1], [2, 3]], [[0, 2], [1, 3]])
    assert hybrid_groups([0, 1, 2, 3, 4, 5], 3) == ([[0, 1, 2], [3, 4, 5]], [[0, 3], [1, 4], [2, 5]])
    assert hybrid_groups([1, 3, 5, 7], 4) == ([[1, 3, 5, 7]], [[1], [3], [5], [7]])  # plain sharding
    assert hybrid_groups([1, 3, 5, 7], 1) == ([[1], [3], [5], [7]], [[1, 3, 5, 7]])  # plain replication


def test_topology_shard_and_replicate_ranks():
    t = Topology(pp=1, dp=4, rank=2, shard=2)
    assert (t.shard, t.replicate, t.shard_ranks, t.replicate_ranks) == (2, 2, [2, 3], [0, 2])
    t = Topology(pp=2, dp=4, rank=5, tp=2, shard=2)  # dp ranks of (stage 0, tp rank 1): 1, 5, 9, 13
    assert t.dp_ranks == [1, 5, 9, 13] and t.shard_ranks == [1, 5] and t.replicate_ranks == [5, 13]
    t = Topology(pp=1, dp=4, rank=3)  # default: one shard group, the data-parallel group
    assert (t.shard, t.replicate, t.shard_ranks, t.replicate_ranks) == (4, 1, [0, 1, 2, 3], [3])
    for rank in range(12):  # every dp rank in exactly one shard group and one replicate group
        t = Topology(pp=1, dp=12, rank=rank, shard=3)
        assert set(t.shard_ranks) & set(t.replicate_ranks) == {rank}
        assert len(t.shard_ranks) * len(t.replicate_ranks) == 12


def test_bad_shard_sizes_are_value_errors():
    assert check_shard(6, None) == 6 and check_shard(6, 3) == 3
    with pytest.raises(ValueError, match=r"shard = 4 does not divide dp = 6"):
        check_shard(6, 4)
    for bad in (0, -2, 1.5, True):
        with pytest.raises(ValueError, match="shard must be a positive integer"):
            Topology(pp=1, dp=4, rank=0, shard=bad)
    with pytest.raises(ValueError, match="does not divide"):
        hybrid_groups([0, 1, 2], 2)
