"""Splitting one graph's backward into I and W without running it twice (zero-bubble on any module).

A traced stage is one autograd graph, not a chain of layers that :mod:`compute` can cut at each
layer's input. I asks autograd for the stage input's gradient only; on the way, a pre-hook on each
*weight node* (a node on the input's path with an edge off it that leads to parameters: a
Linear's addmm, a LayerNorm, ...) keeps the gradient arriving at it. W then starts at each weight node with the kept
gradient and asks for that node's own parameters only, so autograd runs the weight-gradient half
of those nodes and nothing else, where asking the whole graph for the parameters would run its
backward again (it must carry gradients through the activations to reach the earlier weights).
torch.distributed.pipelining splits the same way (``stage_backward_input`` and
``stage_backward_weight``, torch/distributed/pipelining/_backward.py), grouping the nodes.

When a parameter hangs below several weight nodes (tied weights) or below none (an embedding
whose gradient never passes the input's path), no kept gradient counts each contribution once:
:func:`split_input_grad` then returns ``None`` and the caller runs W over the whole graph.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.autograd import graph
from torch.autograd.graph import GradientEdge, Node

# torch.autograd.backward's own last step (torch/autograd/__init__.py): the engine, without the
# Python checks before it (argument forms, torch-function overrides, gradient shapes), which W's
# kept gradients, handed out by the engine itself, pass by construction. Those checks are half a
# small weight node's W call (about 60 of 125 us on a LayerNorm's); the public call if torch drops it.
_run_backward = getattr(graph, "_engine_run_backward", None)

Kept = list[tuple[Node, tuple, list[torch.Tensor]]]  # weight node, gradient kept at it, its parameters


def _children(node: Node) -> list[Node]:
    return [n for n, _ in node.next_functions if n is not None]


def _leaf(node: Node) -> int | None:
    var = getattr(node, "variable", None)  # an AccumulateGrad's tensor
    return None if var is None else id(var)


def on_input_path(roots: Sequence[Node], ins: Sequence[torch.Tensor]) -> set[Node]:
    """The nodes from which an input's accumulator is reachable: what I runs (iterative post-order)."""
    targets = {id(t) for t in ins}
    path: set[Node] = set()
    done: set[Node] = set()
    stack = [(r, False) for r in roots if r is not None]
    while stack:
        node, expanded = stack.pop()
        if node in done:
            continue
        if not expanded:
            stack.append((node, True))
            stack.extend((c, False) for c in _children(node) if c not in done)
            continue
        done.add(node)
        if _leaf(node) in targets or any(c in path for c in _children(node)):
            path.add(node)
    return path


def weight_nodes(roots: Sequence[Node], ins: Sequence[torch.Tensor],
                 params: Sequence[torch.Tensor]) -> dict[Node, list[torch.Tensor]] | None:
    """Each node on the input's path with an edge off it that leads to ``params`` (a Linear's
    addmm, whose weight hangs below a transpose), with those parameters; None if a parameter
    hangs below several such nodes or below none (only structure is walked, nothing computed)."""
    want = {id(p): p for p in params}
    path = on_input_path(roots, ins)
    found: dict[Node, list[torch.Tensor]] = {}
    owners: dict[int, int] = {}
    for node in path:
        for child in _children(node):
            if child in path:
                continue
            below, stack, seen = [], [child], set()
            while stack:  # off the path: everything below leads to parameters only
                n = stack.pop()
                if n in seen:
                    continue
                seen.add(n)
                if _leaf(n) in want:
                    below.append(want[_leaf(n)])
                stack.extend(_children(n))
            for p in below:
                owners[id(p)] = owners.get(id(p), 0) + 1
            if below:
                found.setdefault(node, []).extend(below)
    if len(owners) != len(want) or any(n != 1 for n in owners.values()):
        return None
    return found


def split_input_grad(outs: Sequence[torch.Tensor], grads: Sequence[torch.Tensor | None] | None,
                     ins: Sequence[torch.Tensor], params: Sequence[torch.Tensor]) -> tuple[tuple, Kept | None] | None:
    """I: the gradients of ``ins`` and what W needs (None: W must run the whole graph); None
    before running anything when a parameter feeds several nodes (the caller runs I itself)."""
    nodes = weight_nodes([o.grad_fn for o in outs], ins, params)
    if not nodes:
        return None
    kept: dict[Node, tuple] = {}
    handles = [node.register_prehook(lambda g, node=node: kept.__setitem__(node, g)) for node in nodes]
    try:
        found = torch.autograd.grad(outs, ins, grads, retain_graph=True, allow_unused=True)
    finally:
        for h in handles:
            h.remove()
    if len(kept) != len(nodes):  # not expected (I runs every node on the path): W runs the whole graph
        return found, None
    # W in the order I reached the nodes (the engine's, the same on every rank of an identical
    # graph), not the set's (hashes differ between processes): a W may issue a collective (a
    # tensor-parallel gradient sum), which every rank of the group must call in the same order.
    return found, [(node, kept[node], nodes[node]) for node in kept]


def split_weight_grad(kept: Kept) -> None:
    """W from what :func:`split_input_grad` kept: each weight node's parameters, accumulated into
    ``.grad`` by autograd itself (so post-accumulate-grad hooks, e.g. DDP's, fire)."""
    for node, grads, params in kept:
        edges = [GradientEdge(node, k) for k, g in enumerate(grads) if g is not None]
        values = [g for g in grads if g is not None]
        if not edges:
            continue
        if _run_backward is None:
            torch.autograd.backward(edges, values, inputs=params)
        else:  # retain_graph=False, create_graph=False, as backward() passes them
            _run_backward(tuple(edges), tuple(values), False, False, tuple(params), allow_unreachable=True,
                          accumulate_grad=True)  # fmt: skip
