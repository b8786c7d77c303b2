"""Cross-entropy over logits split by vocabulary columns, without any rank holding a full row.

Per token, with l_v the logits and t the target: loss = log sum_v exp(l_v - m) - (l_t - m), m the
row's maximum. Each rank has a block of v; it sends the group three numbers per token: its block's
maximum (all-reduced by max), then its block's sum of exponentials and, where t falls in its block,
l_t - m (one all-reduce of both by sum). The gradient, softmax minus the one-hot target, is each
rank's own block of columns, so backward communicates nothing (Megatron-LM's vocab-parallel loss).
"""

from __future__ import annotations

import torch
from torch.autograd import Function

from commlab.tensor.comm import TPGroup


class _VocabCrossEntropy(Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, target: torch.Tensor, tp: TPGroup):
        width = logits.shape[-1]
        lo = tp.rank * width
        peak = tp.all_reduce(logits.max(dim=-1).values.clone(), "max")
        shifted = logits - peak.unsqueeze(-1)
        mine = (target >= lo) & (target < lo + width)
        column = (target - lo).clamp(0, width - 1)
        exp = shifted.exp()
        sums = torch.stack([exp.sum(-1), shifted.gather(-1, column.unsqueeze(-1)).squeeze(-1) * mine])
        tp.all_reduce(sums)
        ctx.save_for_backward(exp.div_(sums[0].unsqueeze(-1)), column, mine)
        return sums[0].log() - sums[1]

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        softmax, column, mine = ctx.saved_tensors
        out = softmax * grad.unsqueeze(-1)  # a new tensor: the saved one stays valid for a second backward
        rows = torch.arange(out.shape[0], device=out.device)
        out[rows, column] -= mine.to(out.dtype) * grad
        return out, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, *, group=None,
                                 algorithm: str = "native", ignore_index: int = -100) -> torch.Tensor:
    """Mean cross-entropy of ``logits`` (``(..., vocab / tp)``, this rank's block of columns, as a
    ``colwise`` head leaves them) against ``target`` (``(...)``, full vocabulary ids); tokens equal
    to ``ignore_index`` count for nothing, as in ``torch.nn.functional.cross_entropy``."""
    if logits.shape[:-1] != target.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and target {tuple(target.shape)} differ before the vocabulary")
    tp = TPGroup.of(group, algorithm)
    # In float32 whatever the logits' dtype (as Megatron does): a half-precision sum of exponentials
    # over the vocabulary loses the small terms. The cast's gradient casts back.
    flat, ids = logits.reshape(-1, logits.shape[-1]).float(), target.reshape(-1)
    keep = ids != ignore_index
    per_token = _VocabCrossEntropy.apply(flat, ids.masked_fill(~keep, 0), tp)
    return (per_token * keep).sum() / keep.sum().clamp(min=1)
