"""One stage's compute for one micro-batch: forward, full backward, and the zero-bubble split I / W.

A split backward (Qi et al., ICLR 2024) needs the gradient of the stage's input first (I) and the
weights' gradients later (W). The stage's forward is run layer by layer, each layer on a detached
copy of its input (:func:`forward_layers`), so each layer's backward is its own small graph.
I walks the layers from the last to the first asking autograd only for each layer input's
gradient (``torch.autograd.grad(out, inp)``: the engine skips the weight-gradient kernels, e.g.
the ``x^T g`` of a Linear), keeping each layer's output gradient. W then asks only for the
weights (``backward(out, g, inputs=params)``), which runs just the skipped kernels. A layer that
is itself a composite (a transformer block) re-traverses its own graph in W; its result is exact.
A traced stage (any module cut by name) is one graph: I keeps the gradient at each node that
feeds a weight, and W starts there (:mod:`weight_split`), as torch's pipelining does.

:func:`recompute` replays a checkpointed forward with the first run's RNG state and restores the
stage's buffers afterwards, so BatchNorm's running statistics are updated once per micro-batch
(by the first forward), not again by the recomputation (torchgpipe guards the same way with its
``is_recomputing`` flag).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from commlab.pipeline.runtime.values import Value, detached, floats, pairs
from commlab.pipeline.runtime.weight_split import split_input_grad, split_weight_grad


@dataclass
class Layer:
    """One layer's forward as its own graph: a detached input, the output, its trainable weights."""

    inp: Value
    out: Value
    params: list[torch.Tensor]
    grad: tuple | None = None  # the output's gradient (one per floating element), kept by I for W
    whole: bool = False  # a whole traced stage: one graph, split by weight nodes (weight_split.py)
    kept: list | None = None  # what I kept at the weight nodes for W (a whole stage's only)


@dataclass
class Stashed:
    """What a micro-batch leaves on a stage between its forward and its backward."""

    x: Value
    rng: tuple | None = None  # set when checkpointed: only x is kept, the forward is recomputed
    y: Value | None = None
    loss: torch.Tensor | None = None
    layers: list[Layer] = field(default_factory=list)  # split backward only
    nbytes: int = 0


def forward_layers(module: nn.Module, x: Value) -> tuple[Value, list[Layer]]:
    """Run an nn.Sequential one layer at a time, each layer's graph cut at its input; any other
    stage (a traced model's) is one layer, whose backward weight_split.py splits."""
    if not isinstance(module, nn.Sequential):
        out = module(x)
        return out, [Layer(x, out, [p for p in module.parameters() if p.requires_grad], whole=True)]
    layers: list[Layer] = []
    h = x
    for k, layer in enumerate(module.children()):
        inp = h if k == 0 else detached(h, grad=True)
        out = layer(inp)
        params = [p for p in layer.parameters() if p.requires_grad]
        layers.append(Layer(inp, out, params))
        h = out
    return h, layers


def input_grad(layers: list[Layer], grad: tuple | None, root: torch.Tensor | None = None) -> tuple | None:
    """I: the gradient of the first layer's input (per floating element); each layer's output
    gradient kept for W. ``root`` is the loss on the last stage (then ``grad`` is None)."""
    if root is not None:
        outs = [t for t in floats(layers[-1].out) if t.requires_grad]
        found = iter(torch.autograd.grad(root, outs, allow_unused=True) if outs else ())
        grad = tuple(next(found) if t.requires_grad else None for t in floats(layers[-1].out))
    for layer in reversed(layers):
        layer.grad = grad
        outs, gs = pairs(layer.out, grad)
        ins = [t for t in floats(layer.inp) if t.requires_grad]
        if not outs or not ins:
            return None
        split = split_input_grad(outs, gs, ins, layer.params) if layer.whole and layer.params else None
        if split is not None:
            found_grads, layer.kept = split
        else:
            found_grads = torch.autograd.grad(outs, ins, gs, retain_graph=True, allow_unused=True)
        found = iter(found_grads)
        grad = tuple(next(found) if t.requires_grad else None for t in floats(layer.inp))
        grad = tuple(g if g is not None else torch.zeros_like(t) for g, t in zip(grad, floats(layer.inp)))
    return grad


def full_grad(layers: list[Layer], grad: tuple | None, root: torch.Tensor | None = None) -> tuple | None:
    """I and W in one pass, for an I whose W follows at once (DualPipeV's full backwards, a rank
    of ZB-H1 that holds none back): each layer's backward accumulates its weights' gradients and
    its input's in one autograd call, instead of I's pass and then W's again."""
    for k, layer in enumerate(reversed(layers)):
        outs, gs = ([root], None) if root is not None and k == 0 else pairs(layer.out, grad)
        ins = [t for t in floats(layer.inp) if t.requires_grad]
        if outs and (ins or layer.params):
            torch.autograd.backward(outs, gs, inputs=[*layer.params, *ins])
        grad = tuple(t.grad if t.grad is not None else torch.zeros_like(t) for t in floats(layer.inp))
    return grad


def weight_grad(layers: list[Layer]) -> None:
    """W: accumulate every layer's weight gradients from the output gradients I kept."""
    for layer in layers:
        if layer.kept is not None:  # only the weight nodes' own halves (weight_split.py)
            split_weight_grad(layer.kept)
        else:
            outs, gs = pairs(layer.out, layer.grad)
            if layer.params and outs:
                torch.autograd.backward(outs, gs, inputs=layer.params)
        layer.grad, layer.kept = None, None


def recompute(module: nn.Module, device: torch.device, rng: tuple, run: Callable[[], tuple]) -> tuple:
    """``run()`` again under the RNG state of the first forward, with grad, buffers left untouched."""
    saved = [b.detach().clone() for b in module.buffers()]
    devices = [device] if device.type == "cuda" else []
    try:
        with torch.random.fork_rng(devices=devices):
            set_rng_state(rng, device)
            with torch.enable_grad():
                return run()
    finally:
        with torch.no_grad():
            for b, value in zip(module.buffers(), saved):
                b.copy_(value)


def rng_state(device: torch.device) -> tuple:
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return (torch.get_rng_state(), cuda)


def set_rng_state(state: tuple, device: torch.device) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state(state[1], device)
