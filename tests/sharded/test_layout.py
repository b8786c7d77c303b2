"""Shard layout and the copies around the collectives, without processes: each parameter's rows
as torch.chunk cuts them (the oracle), padded pieces laid rank-major, and copy-in/copy-out."""

import pytest
import torch

from commlab.sharded import copies
from commlab.sharded.layout import shard_layout


def test_the_docstring_example():
    layout = shard_layout([(3,), (2, 2)], 2)
    assert [layout.chunk_rows(i) for i in range(2)] == [2, 1]
    assert layout.shard_numels == (2, 2) and layout.shard_offsets == (0, 2)
    assert (layout.total, layout.shard_size, layout.padded, layout.padding) == (7, 4, 8, 1)
    assert layout.offsets == (0, 3)
    assert [layout.local_shape(0, r) for r in range(2)] == [(2,), (1,)]
    assert [layout.valid(r) for r in range(2)] == [4, 3]


def test_more_ranks_than_rows_leaves_ranks_empty_as_torch_chunk():
    layout = shard_layout([(2, 3)], 5)  # c = 1: ranks 2-4 hold no rows
    assert [layout.local_rows(0, r) for r in range(5)] == [1, 1, 0, 0, 0]
    assert layout.padded == 15 and layout.padding == 9


SHAPES = [[(1,)], [(5,)], [(3,), (2, 2)], [(10, 3), (1,), (7,), (2, 5)], [(64, 64)], [(13, 2)] * 5, [(1,), (100,), (1, 4)]]


@pytest.mark.parametrize("world", [1, 2, 3, 4, 7])
@pytest.mark.parametrize("shapes", SHAPES)
def test_pieces_are_torch_chunks_and_copies_round_trip(shapes, world):
    layout = shard_layout(shapes, world)
    g = torch.Generator().manual_seed(world)
    values = [torch.randn(s, generator=g) for s in shapes]
    flat = torch.full((layout.padded,), float("nan"))
    for i, v in enumerate(values):
        copies.copy_in(flat, layout, i, v, scale=2.0)
    assert not flat.isnan().any()  # every padding element written (zeros)
    for rank in range(world):
        lo, hi = layout.shard_range(rank)
        for i, v in enumerate(values):
            chunks = list(torch.chunk(v, world, dim=0))
            expected = chunks[rank] if rank < len(chunks) else v[:0]
            assert layout.local_shape(i, rank) == tuple(expected.shape)
            assert torch.equal(copies.local_rows(v, layout, i, rank), expected)
            assert torch.equal(copies.in_shard(flat[lo:hi], layout, i, rank), 2.0 * expected)
    assert flat.abs().sum() == pytest.approx(2.0 * sum(v.abs().sum().item() for v in values), rel=1e-5)
    for i, v in enumerate(values):
        out = torch.empty_like(v)
        copies.copy_out(flat, layout, i, out)
        assert torch.equal(out, 2.0 * v)
    assert sum(layout.valid(r) for r in range(world)) == layout.total


def test_bad_layouts_are_refused():
    with pytest.raises(ValueError, match="world_size"):
        shard_layout([(3,)], 0)
    with pytest.raises(ValueError, match="at least one parameter"):
        shard_layout([], 2)
    with pytest.raises(ValueError, match="at least one element"):
        shard_layout([(3,), (0, 2)], 2)
    with pytest.raises(ValueError, match="0-dimensional"):
        shard_layout([()], 2)
    with pytest.raises(ValueError, match="rank 2"):
        shard_layout([(3,)], 2).shard_range(2)
