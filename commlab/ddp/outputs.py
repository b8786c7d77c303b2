"""Model outputs as DDP sees them: the tensors inside any structure, and the sink they pass through.

Two walks, as torch's DistributedDataParallel does them (torch/nn/parallel/distributed.py):
``find_tensors`` looks into lists, tuples (namedtuples too), dicts and dataclasses to find where
the unused-parameter search starts (torch's ``_find_tensors``); the sink is applied to the leaves
of ``torch.utils._pytree.tree_flatten`` (torch's ``_tree_flatten_with_rref``), which does not open
dataclasses -- so a dataclass output is searched but not sunk, in torch as here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils._pytree import tree_flatten


def find_tensors(obj: Any) -> Iterator[torch.Tensor]:
    """Every tensor in ``obj``, depth first; fields that are None (or anything else) are skipped."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            yield from find_tensors(item)
    elif isinstance(obj, dict):
        for item in obj.values():
            yield from find_tensors(item)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for field in dataclasses.fields(obj):
            yield from find_tensors(getattr(obj, field.name))


class _Sink(torch.autograd.Function):
    """Identity (a clone, as torch's _DDPSink) whose backward runs first among the outputs', so
    the reducer starts even on a rank where no parameter gets a gradient. Gradients are not
    materialised: an output the loss does not use sends None on, so the parameters behind it get
    an undefined gradient and count as unused, as in torch."""

    @staticmethod
    def forward(ctx, on_backward: Callable[[], None], *tensors: torch.Tensor):
        ctx.set_materialize_grads(False)
        ctx.on_backward = on_backward
        return tuple(t.clone() for t in tensors)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor | None):
        ctx.on_backward()
        return (None, *grads)


def through_sink(output: Any, on_backward: Callable[[], None]) -> Any:
    """``output`` with each tensor leaf that has a grad_fn replaced by its pass through the sink
    (tensors without one are left alone, as torch does since pytorch/pytorch#60733)."""
    flat, spec = tree_flatten(output)
    positions = [i for i, t in enumerate(flat) if isinstance(t, torch.Tensor) and t.grad_fn is not None]
    if not positions:
        return output
    passed = _Sink.apply(on_backward, *[flat[i] for i in positions])
    for i, t in zip(positions, passed):
        flat[i] = t
    return spec.unflatten(flat)
