"""Megatron's conjugate operators (Shoeybi et al. 2019) and their sequence-parallel pair, as autograd functions.

Each operator is one collective in one direction and its adjoint in the other:

    copy_to           identity        | all-reduce       before a column-split layer (Megatron's f)
    reduce_from       all-reduce      | identity         after a row-split layer (Megatron's g)
    gather_from       all-gather      | reduce-scatter   f with sequence parallelism (Korthikanti et al.)
    reduce_scatter_to reduce-scatter  | all-gather       g with sequence parallelism
    split             own block       | all-gather       entering a sharded region from replicated values
    gather            all-gather      | own block        leaving one into replicated values

The adjoint follows from what the other ranks hold: after ``copy_to`` each rank's column block
yields only its part of the input gradient, so the parts are summed; after ``gather`` every rank
computes the same full gradient, so each keeps its block without communicating.
"""

from __future__ import annotations

import torch
from torch.autograd import Function

from commlab.tensor.comm import TPGroup


class _CopyTo(Function):
    @staticmethod
    def forward(ctx, x, tp: TPGroup):
        ctx.tp = tp
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return ctx.tp.all_reduce(grad.contiguous().clone()), None


class _ReduceFrom(Function):
    @staticmethod
    def forward(ctx, x, tp: TPGroup):
        return tp.all_reduce(x.contiguous().clone())

    @staticmethod
    def backward(ctx, grad):
        return grad, None


# The four operators along a dimension differ only in which of these runs each way.
_ALONG = {
    "all_gather": lambda tp, x, dim: tp.all_gather(x.contiguous(), dim),
    "reduce_scatter": lambda tp, x, dim: tp.reduce_scatter(x, dim),
    "own_block": lambda tp, x, dim: tp.own_block(x, dim),
}


class _Along(Function):
    """``forward_op`` on the value and ``backward_op`` on its gradient, both along ``dim``."""

    @staticmethod
    def forward(ctx, x, tp: TPGroup, dim: int, forward_op: str, backward_op: str):
        ctx.tp, ctx.dim, ctx.backward_op = tp, dim, backward_op
        return _ALONG[forward_op](tp, x, dim)

    @staticmethod
    def backward(ctx, grad):
        return _ALONG[ctx.backward_op](ctx.tp, grad, ctx.dim), None, None, None, None


def copy_to(x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    """Identity forward; the input gradient summed over the group backward."""
    return _CopyTo.apply(x, tp)


def reduce_from(x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    """Partial outputs summed over the group forward; the gradient passed through backward."""
    return _ReduceFrom.apply(x, tp)


def gather_from(x: torch.Tensor, tp: TPGroup, dim: int = 1) -> torch.Tensor:
    """Shards concatenated along ``dim`` forward; the gradient reduce-scattered backward."""
    return _Along.apply(x, tp, dim, "all_gather", "reduce_scatter")


def reduce_scatter_to(x: torch.Tensor, tp: TPGroup, dim: int = 1) -> torch.Tensor:
    """Partial outputs summed and this rank's block along ``dim`` kept forward; gradient all-gathered."""
    return _Along.apply(x, tp, dim, "reduce_scatter", "all_gather")


def split(x: torch.Tensor, tp: TPGroup, dim: int = 1) -> torch.Tensor:
    """This rank's block along ``dim`` of a replicated value forward; the gradient all-gathered."""
    return _Along.apply(x, tp, dim, "own_block", "all_gather")


def gather(x: torch.Tensor, tp: TPGroup, dim: int = -1) -> torch.Tensor:
    """Shards concatenated along ``dim`` into a replicated value forward; own block of the gradient."""
    return _Along.apply(x, tp, dim, "all_gather", "own_block")
