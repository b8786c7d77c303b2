"""What crosses a stage boundary: one tensor or a tuple of tensors, and the gradients that come back.

A stage of a partitioned nn.Sequential passes its output to the next stage as nn.Sequential would:
as one argument, which may be a tuple (torch.distributed.pipelining also accepts tuple outputs).
On the wire a value is its flat list of tensors, one message each. Only floating-point elements
carry a gradient back: a whole-number element (token ids, indices) is sent forward and nothing
returns for it. So a gradient is always a tuple with one tensor per floating-point element of the
value, in order (:func:`floats`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

Value = torch.Tensor | tuple  # a tensor, or a tuple of tensors
MAX_PARTS = 16  # elements of a tuple crossing a boundary (each needs its own message tag)


@dataclass(frozen=True)
class Boundary:
    """What crosses from one stage to the next: micro-batch sizes, and per element of the value
    (one tensor, or each of a tuple's: ``packed``) its per-sample shape and dtype (``whole``: its
    whole shape, the same for every micro-batch, as a traced model's static shapes are)."""

    sizes: tuple[int, ...]
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[torch.dtype, ...]
    packed: bool = False
    whole: bool = False

    @classmethod
    def of(cls, sizes: tuple[int, ...], value: Value) -> Boundary:
        parts = flat(value)
        return cls(sizes, tuple(tuple(t.shape[1:]) for t in parts), tuple(t.dtype for t in parts), isinstance(value, tuple))

    def buffers(self, microbatch: int, device: torch.device, grads: bool = False) -> list[torch.Tensor]:
        """Receive buffers for the value (``grads``: for its gradient, the floating elements only)."""
        lead = () if self.whole else (self.sizes[microbatch],)
        return [torch.empty((*lead, *shape), dtype=dtype, device=device)
                for shape, dtype in zip(self.shapes, self.dtypes) if not grads or dtype.is_floating_point]  # fmt: skip

    def sample(self, device: torch.device) -> Value:
        """A one-sample zero value of this boundary's layout."""
        zeros = [torch.zeros((1, *shape), dtype=dtype, device=device) for shape, dtype in zip(self.shapes, self.dtypes)]
        return rebuild(zeros, self.packed)


def flat(value: Value | None) -> tuple[torch.Tensor, ...]:
    """The tensors of a value, in order (a gradient tuple is a value too)."""
    if value is None:
        return ()
    return (value,) if isinstance(value, torch.Tensor) else tuple(value)


def floats(value: Value | None) -> tuple[torch.Tensor, ...]:
    """The floating-point elements: those a gradient flows through."""
    return tuple(t for t in flat(value) if t.is_floating_point())


def rebuild(tensors: Sequence[torch.Tensor], packed: bool) -> Value:
    """The value from its flat tensors: a tuple if the stage returned one."""
    return tuple(tensors) if packed else tensors[0]


def detached(value: Value, grad: bool) -> Value:
    """A copy cut from the graph; with ``grad`` its floating-point elements become leaves needing grad."""
    out = []
    for t in flat(value):
        t = t.detach()
        out.append(t.requires_grad_(True) if grad and t.is_floating_point() else t)
    return rebuild(out, not isinstance(value, torch.Tensor))


def pairs(value: Value, grads: Sequence[torch.Tensor | None] | None) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(outputs, their gradients) for autograd: the floating elements that need grad and have one."""
    outs, gs = [], []
    for t, g in zip(floats(value), grads or ()):
        if t.requires_grad and g is not None:
            outs.append(t)
            gs.append(g)
    return outs, gs


def leaf_grads(value: Value) -> tuple[torch.Tensor, ...]:
    """After a backward: the gradient of each floating-point leaf of ``value`` (zeros if unused)."""
    return tuple(t.grad if t.grad is not None else torch.zeros_like(t) for t in floats(value))


def check_output(stage: int, out) -> str | None:
    """Why ``out`` cannot cross a boundary, or None if it can."""
    if isinstance(out, torch.Tensor):
        return None
    if isinstance(out, tuple) and out and all(isinstance(t, torch.Tensor) for t in out):
        if len(out) > MAX_PARTS:
            return f"stage {stage} returns a tuple of {len(out)} tensors: at most {MAX_PARTS} may cross a boundary"
        return None
    kinds = type(out).__name__ if not isinstance(out, tuple) else "a tuple of " + ", ".join(type(t).__name__ for t in out)
    return f"stage {stage} must return a tensor or a tuple of tensors, got {kinds or 'an empty tuple'}"
