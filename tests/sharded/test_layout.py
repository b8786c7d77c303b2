"""Shard layout without processes: padded sizes, shard ranges and each parameter's pieces."""

import itertools

import pytest

from commlab.sharded.layout import Piece, shard_layout


def test_the_docstring_example():
    layout = shard_layout([3, 2], 2)
    assert (layout.total, layout.padded, layout.shard_size, layout.padding) == (5, 6, 3, 1)
    assert layout.offsets == (0, 3)
    assert layout.shard_range(0) == (0, 3) and layout.shard_range(1) == (3, 6)
    assert layout.pieces(0) == [Piece(0, 0, 3, 0)]
    assert layout.pieces(1) == [Piece(1, 0, 2, 0)]
    assert [layout.valid(r) for r in range(2)] == [3, 2]


def test_a_parameter_split_across_three_ranks():
    layout = shard_layout([7], 3)  # shard size 3: 0-2, 3-5, 6 + two padding
    assert layout.padded == 9 and layout.padding == 2
    assert [layout.pieces(r) for r in range(3)] == [
        [Piece(0, 0, 3, 0)], [Piece(0, 3, 6, 0)], [Piece(0, 6, 7, 0)]
    ]


def test_one_element_parameters_and_more_ranks_than_elements():
    layout = shard_layout([1, 1], 5)  # shard size 1: ranks 2-4 hold only padding
    assert (layout.shard_size, layout.padded, layout.padding) == (1, 5, 3)
    assert layout.pieces(0) == [Piece(0, 0, 1, 0)] and layout.pieces(1) == [Piece(1, 0, 1, 0)]
    assert layout.pieces(2) == layout.pieces(3) == layout.pieces(4) == []
    assert [layout.valid(r) for r in range(5)] == [1, 1, 0, 0, 0]


def test_a_shard_holding_the_ends_of_several_parameters():
    layout = shard_layout([2, 1, 4], 2)  # flat a a b c c c c + 1 pad, shard size 4
    assert layout.pieces(0) == [Piece(0, 0, 2, 0), Piece(1, 0, 1, 2), Piece(2, 0, 1, 3)]
    assert layout.pieces(1) == [Piece(2, 1, 4, 0)]


@pytest.mark.parametrize("world", [1, 2, 3, 4, 7, 16])
@pytest.mark.parametrize("numels", [[1], [5], [1, 1, 1], [3, 2], [10, 1, 7, 2], [64, 64], [13] * 5, [1, 100, 1]])
def test_pieces_tile_every_element_exactly_once(numels, world):
    layout = shard_layout(numels, world)
    assert layout.padded % world == 0 and 0 <= layout.padding < world
    assert layout.padded == layout.shard_size * world >= layout.total
    covered = {i: [] for i in range(len(numels))}
    for rank in range(world):
        lo, hi = layout.shard_range(rank)
        assert hi - lo == layout.shard_size
        last_end = 0
        for piece in layout.pieces(rank):
            assert piece.numel > 0 and piece.shard_start >= last_end  # in flat order, no overlap
            last_end = piece.shard_start + piece.numel
            assert last_end <= layout.shard_size
            # The piece sits where the flat buffer says it does.
            assert lo + piece.shard_start == layout.offsets[piece.param] + piece.param_start
            covered[piece.param].extend(range(piece.param_start, piece.param_end))
    for i, n in enumerate(numels):
        assert covered[i] == list(range(n))  # every element once, in rank order
    assert sum(layout.valid(r) for r in range(world)) == layout.total
    # Only the last ranks carry padding, and all of it.
    valid = [layout.valid(r) for r in range(world)]
    assert all(a >= b for a, b in itertools.pairwise(valid))


def test_bad_layouts_are_refused():
    with pytest.raises(ValueError, match="world_size"):
        shard_layout([3], 0)
    with pytest.raises(ValueError, match="at least one parameter"):
        shard_layout([], 2)
    with pytest.raises(ValueError, match="at least one element"):
        shard_layout([3, 0], 2)
    with pytest.raises(ValueError, match="rank 2"):
        shard_layout([3], 2).shard_range(2)
