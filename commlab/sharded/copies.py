"""Copies between a bucket's unsharded parameters (or gradients) and its rank-major flat buffer.

The collectives run on the rank-major buffer (commlab/sharded/layout.py): rank r's block holds
rank r's row piece of every parameter. Computation needs each parameter whole and contiguous.
So, as torch's ``fully_shard`` does around its collectives
(torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py: a copy-in before the all-gather, a
``split_with_sizes_copy`` out of it, a copy of the unsharded gradients into the reduce-scatter
input), a bucket copies: a full tensor into the buffer (gradients before the reduce-scatter,
zero padding), the buffer out into full tensors (parameters after the all-gather), and a rank's
pieces into its own block (stages 1-2, before the all-gather). Each parameter is one strided copy
of at most three parts: the ranks holding whole pieces, the one holding a partial piece, and the
padding.
"""

from __future__ import annotations

import torch

from commlab.sharded.layout import ShardLayout


def _pieces(buffer: torch.Tensor, layout: ShardLayout, i: int) -> torch.Tensor:
    """Parameter i's N padded pieces inside the rank-major ``buffer``: a (N, c, row) view."""
    a, c = layout.shard_offsets[i], layout.chunk_rows(i)
    blocks = buffer.view(layout.world_size, layout.shard_size)
    return blocks[:, a : a + layout.shard_numels[i]].view(layout.world_size, c, layout.row_numel(i))


def copy_in(buffer: torch.Tensor, layout: ShardLayout, i: int, full: torch.Tensor, scale: float | None = None) -> None:
    """Write the full tensor ``full`` of parameter i into its pieces of ``buffer`` (times ``scale``
    if given, fused into the copy), and zeros into its padding rows."""
    dst = _pieces(buffer, layout, i)
    rows, c = layout.shapes[i][0], layout.chunk_rows(i)
    src = full.reshape(rows, layout.row_numel(i))
    whole, rest = divmod(rows, c)
    parts = [(dst[:whole], src[: whole * c].view(whole, c, -1))]
    if rest:
        parts.append((dst[whole, :rest], src[whole * c :]))
        dst[whole, rest:].zero_()
    dst[whole + (1 if rest else 0) :].zero_()
    for d, s in parts:
        scaled_copy(d, s, scale)


def scaled_copy(dst: torch.Tensor, src: torch.Tensor, scale: float | None = None) -> None:
    """``dst = src * scale``, the product taken in ``dst``'s dtype: a 16-bit gradient copied into an
    fp32 reduction is cast first, so that 1/N (N not a power of two) is not rounded to 16 bits."""
    if scale is None:
        dst.copy_(src)
    elif src.dtype == dst.dtype:
        torch.mul(src, scale, out=dst)
    else:
        dst.copy_(src)
        dst.mul_(scale)


def copy_out(buffer: torch.Tensor, layout: ShardLayout, i: int, full: torch.Tensor) -> None:
    """Write parameter i's pieces of ``buffer`` (padding left out) into the full tensor ``full``."""
    src = _pieces(buffer, layout, i)
    rows, c = layout.shapes[i][0], layout.chunk_rows(i)
    dst = full.view(rows, layout.row_numel(i))
    whole, rest = divmod(rows, c)
    dst[: whole * c].view(whole, c, -1).copy_(src[:whole])
    if rest:
        dst[whole * c :].copy_(src[whole, :rest])


def local_rows(full: torch.Tensor, layout: ShardLayout, i: int, rank: int) -> torch.Tensor:
    """Rank's rows of the full tensor ``full`` of parameter i, as a view in the local shape."""
    start = rank * layout.chunk_rows(i)
    rows = layout.local_rows(i, rank)
    return full.view(layout.shapes[i][0], -1)[start : start + rows].view(layout.local_shape(i, rank))


def in_shard(shard: torch.Tensor, layout: ShardLayout, i: int, rank: int) -> torch.Tensor:
    """Parameter i's rows inside rank's flat ``shard`` (its block of the rank-major buffer), as a
    view in the local shape; the piece's padding rows are left out."""
    a = layout.shard_offsets[i]
    n = layout.local_rows(i, rank) * layout.row_numel(i)
    return shard[a : a + n].view(layout.local_shape(i, rank))
