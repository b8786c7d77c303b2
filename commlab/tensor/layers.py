"""The split layers that replace a plan's Linear and Embedding modules, each holding only its block.

A layer is built from the module it replaces (its parameters sliced and copied, so the original's
full weights can be freed) and keeps the names ``weight`` and ``bias``, so a state dict, an
optimizer over ``parameters()`` and ``full_state_dict`` see the original's names. ``tp_split``
says which parameter is split along which dimension; a parameter not in it is whole on every rank.

With sequence parallelism, activations between the layers are blocks of the sequence (dimension
1 of ``(batch, seq, features)``): a column layer gathers its input, a row layer reduce-scatters
its output, and a row layer's bias, added to a block of the sequence, gets a partial gradient,
which a hook sums over the group.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from commlab.tensor import operators as ops
from commlab.tensor.comm import TPGroup
from commlab.tensor.shards import block

SEQUENCE_DIM = 1  # (batch, seq, features), as torch's SequenceParallel assumes by default


class InputCache:
    """One collective per distinct input: q, k and v all read the same normalised activation, so its
    gather (forward) and its gradient's reduction (backward) run once, as for a fused qkv layer.
    Keyed on the tensor object, which the cache keeps alive, so the key cannot be reused; emptied
    before every forward of the whole model, so a graph already backpropagated is never reused."""

    def __init__(self) -> None:
        self.key: torch.Tensor | None = None
        self.value: torch.Tensor | None = None

    def clear(self, *_) -> None:
        self.key = self.value = None

    def get(self, x: torch.Tensor, make) -> torch.Tensor:
        if self.key is not x or self.value.requires_grad != torch.is_grad_enabled():
            self.key, self.value = x, make(x)
        return self.value


def sum_gradient_hook(tp: TPGroup):
    """A tensor hook that sums a gradient over the group (for whole parameters used on a block)."""
    return lambda grad: tp.all_reduce(grad.contiguous().clone())


def _param(value: torch.Tensor, like: nn.Parameter) -> nn.Parameter:
    return nn.Parameter(value.detach().clone().contiguous(), requires_grad=like.requires_grad)


class ColwiseLinear(nn.Module):
    """A Linear's block of output features; the output stays split unless ``gather_output``."""

    def __init__(self, linear: nn.Linear, tp: TPGroup, cache: InputCache, *, sequence_parallel: bool,
                 gather_output: bool):
        super().__init__()
        lo, hi = block(linear.out_features, tp.size, tp.rank)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.tp, self.cache, self.sequence_parallel, self.gather_output = tp, cache, sequence_parallel, gather_output
        self.weight = _param(linear.weight[lo:hi], linear.weight)
        self.bias = None if linear.bias is None else _param(linear.bias[lo:hi], linear.bias)
        self.tp_split = {"weight": 0, "bias": 0}

    def _enter(self, x: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel:
            return ops.gather_from(x, self.tp, SEQUENCE_DIM)
        return ops.copy_to(x, self.tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(self.cache.get(x, self._enter), self.weight, self.bias)
        return ops.gather(y, self.tp, -1) if self.gather_output else y

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features} "
                f"(this rank: {self.weight.shape[0]}), tp={self.tp.size}, gather_output={self.gather_output}")


class RowwiseLinear(nn.Module):
    """A Linear's block of input features, on an input already split so; output summed over the group."""

    def __init__(self, linear: nn.Linear, tp: TPGroup, *, sequence_parallel: bool):
        super().__init__()
        lo, hi = block(linear.in_features, tp.size, tp.rank)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.tp, self.sequence_parallel = tp, sequence_parallel
        self.weight = _param(linear.weight[:, lo:hi], linear.weight)
        self.bias = None if linear.bias is None else _param(linear.bias, linear.bias)
        if self.bias is not None and sequence_parallel and self.bias.requires_grad:
            self.bias.register_hook(sum_gradient_hook(tp))
        self.tp_split = {"weight": 1}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.weight.shape[1]:
            raise ValueError(f"a rowwise layer takes its block of the {self.in_features} input features "
                             f"({self.weight.shape[1]}), got an input of {x.shape[-1]}: put a colwise layer before it")
        y = F.linear(x, self.weight)  # the bias is added once, after the sum
        y = ops.reduce_scatter_to(y, self.tp, SEQUENCE_DIM) if self.sequence_parallel else ops.reduce_from(y, self.tp)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features} (this rank: {self.weight.shape[1]}), "
                f"out_features={self.out_features}, tp={self.tp.size}")


class VocabEmbedding(nn.Module):
    """An Embedding's block of vocabulary rows: a token outside it contributes zeros, and the sum
    over the group is every token's row. The output is whole (replicated) even with sequence
    parallelism, so that position embeddings can be added before the sequence is split."""

    def __init__(self, embedding: nn.Embedding, tp: TPGroup):
        super().__init__()
        if embedding.padding_idx is not None or embedding.max_norm is not None or embedding.sparse:
            raise ValueError("a vocab-parallel Embedding takes no padding_idx, max_norm or sparse gradients")
        self.rows = block(embedding.num_embeddings, tp.size, tp.rank)
        self.num_embeddings, self.embedding_dim = embedding.num_embeddings, embedding.embedding_dim
        self.tp = tp
        self.weight = _param(embedding.weight[self.rows[0]:self.rows[1]], embedding.weight)
        self.tp_split = {"weight": 0}

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        lo, hi = self.rows
        outside = (tokens < lo) | (tokens >= hi)
        rows = F.embedding((tokens - lo).masked_fill(outside, 0), self.weight)
        return ops.reduce_from(rows.masked_fill(outside.unsqueeze(-1), 0.0), self.tp)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim} (this rank: rows {self.rows[0]}-{self.rows[1] - 1}), tp={self.tp.size}"
