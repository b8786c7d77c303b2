"""The pp x dp grid and its validation, without processes (its groups: tests/pipeline/test_hybrid.py)."""

import pytest

import commlab
from commlab.runtime.topology import Topology, grid


def test_grid_is_arange_view_pp_dp():
    assert grid(2, 3) == [[0, 1, 2], [3, 4, 5]]
    assert grid(1, 4) == [[0, 1, 2, 3]] and grid(4, 1) == [[0], [1], [2], [3]]


def test_coordinates_and_peer_ranks():
    t = Topology(pp=2, dp=3, rank=4)
    assert (t.world_size, t.stage, t.replica) == (6, 1, 1)
    assert t.pp_ranks == [1, 4] and t.dp_ranks == [3, 4, 5]
    assert commlab.Topology is Topology


def test_bad_dimensions_are_value_errors():
    with pytest.raises(ValueError, match="pp must be a positive integer"):
        Topology(pp=0, dp=2, rank=0)
    with pytest.raises(ValueError, match="dp must be a positive integer"):
        grid(2, 1.5)
    with pytest.raises(ValueError, match="outside a 2 x 2 grid"):
        Topology(pp=2, dp=2, rank=4)
    with pytest.raises(RuntimeError, match="initialised process group"):
        Topology.build(2, 2)
