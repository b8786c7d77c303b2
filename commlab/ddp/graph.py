"""Autograd-graph search: which parameters the graph behind some outputs cannot reach.

DDP with ``find_unused_parameters=True`` needs this after every forward (torch's Reducer does the
same walk in C++ in ``prepare_for_backward``): a parameter whose gradient accumulator is not in
the graph will get no gradient hook in this backward, so its bucket must be filled without it.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence

import torch


def grad_accumulators(params: Sequence[torch.Tensor]) -> list:
    """Each parameter's AccumulateGrad node. Keep the list alive: a node that nobody holds is
    recreated later as a different object, and the search below matches nodes by identity."""
    with torch.enable_grad():  # DDP may be built under no_grad, where view_as records nothing
        return [p.view_as(p).grad_fn.next_functions[0][0] for p in params]


def reachable(outputs: Sequence[torch.Tensor]) -> set:
    """Every autograd node of the graph behind ``outputs`` (nodes compare by identity). One walk
    per iteration serves the dense and the sparse reducer, each with its own accumulators."""
    seen = set()
    stack = [t.grad_fn for t in outputs if t.grad_fn is not None]
    while stack:
        fn = stack.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        stack.extend(nxt for nxt, _ in fn.next_functions)
    return seen


def unreached(reached: set, accumulator_index: dict) -> list[int]:
    """Indices (values of ``accumulator_index``) of the accumulators not in ``reached`` (from
    :func:`reachable`), in increasing order."""
    hit = {index for acc, index in accumulator_index.items() if acc in reached}
    return sorted(set(accumulator_index.values()) - hit)


def unreachable(outputs: Sequence[torch.Tensor], accumulator_index: dict) -> list[int]:
    """Indices of the accumulators the graph from ``outputs`` does not reach, in increasing order."""
    return unreached(reachable(outputs), accumulator_index)


def weak_hook(reducer: weakref.ref, index: int) -> Callable[[torch.Tensor], None]:
    """A post-accumulate-grad hook that reaches its reducer through a weak reference, so the
    hooks (held by the parameters) do not keep a dropped DDP and its buckets alive."""

    def hook(param: torch.Tensor) -> None:
        live = reducer()
        if live is not None:
            live._on_gradient(index, param)

    return hook
