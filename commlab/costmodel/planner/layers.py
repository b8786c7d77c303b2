"""The planner's profile of a model: per layer (:func:`profile`), and every candidate stage whole.

:func:`profile` times each layer of an nn.Sequential alone (forward + backward, forward, the split
backward's I and W) and counts what it saves for backward, sends and holds: a
:class:`~commlab.costmodel.planner.plan.LayerProfile`. :func:`profile_mlp` profiles the planner's MLP at
each micro-batch size and, given the plans it will price, times every stage they can have whole
(:mod:`commlab.costmodel.planner.stages`), which the planner prefers over the per-layer sums.
"""

from __future__ import annotations

import time
from dataclasses import replace
from collections.abc import Mapping, Sequence

import torch

from commlab.costmodel.planner.plan import LayerProfile
from commlab.pipeline.runtime.memory import SavedBytes
from commlab.pipeline.runtime.partition import best_per_layer, profile_times
from commlab.runtime.threads import rank_threads


def profile_mlp(depth: int, width: int, batch: int, microbatches: Sequence[int], ranks: int,
                plans: Mapping | None = None) -> dict[int, LayerProfile]:  # fmt: skip
    """The planner's MLP (commlab.models.mlp) profiled at the micro-batch size of each count; with
    ``plans`` (``virtuals``, ``schedules``, ``balance_mode`` of :func:`candidates`) every stage they
    can have is also timed whole (:func:`commlab.costmodel.planner.stages.add_stage_times`)."""
    import torch.nn.functional as F

    from commlab.models import mlp

    torch.manual_seed(0)
    model = mlp(depth, width)
    with rank_threads(ranks):  # profiled with the threads a rank gets, not the parent's
        samples = {m: torch.randn(batch // m, width) for m in microbatches}
        targets = {m: torch.randint(0, 10, (batch // m,)) for m in microbatches}  # the bench's loss: cross-entropy, 10 classes
        losses = {m: (lambda y, t=targets[m]: F.cross_entropy(y, t)) for m in microbatches}
        profiles = {m: replace(profile(model, samples[m]), loss_saved=loss_saved_bytes(model, samples[m], losses[m])) for m in microbatches}
        if plans is None:
            return profiles
        from commlab.costmodel.planner.stages import add_stage_times

        return add_stage_times(profiles, list(model), samples, losses, plans.get("ranks", ranks), plans["virtuals"], plans["schedules"],
                               plans.get("balance_mode", "time"))  # fmt: skip


def profile(model, sample, repeat: int = 3) -> LayerProfile:
    """Profile ``model`` (an nn.Sequential) on ``sample`` (one micro-batch): see :class:`LayerProfile`.

    Times are the best of ``repeat``: forward + backward, forward alone, and the split backward's
    I (``autograd.grad`` for the input only) and W (``backward(inputs=params)``), as the executor
    runs them (:mod:`commlab.pipeline.runtime.compute`)."""
    # B (one fused backward) costs less than I + W, so it is timed on its own (profile_times).
    seconds = profile_times(model, sample, repeat=repeat)
    saved, output, params, sizes = [], [], [], []
    sync = torch.cuda.synchronize if sample.is_cuda else (lambda: None)  # time kernels, not launches

    def now() -> float:
        sync()
        return time.perf_counter()

    def split_backward(layer, x) -> tuple:
        """(output, forward, I, W) seconds of one layer, as the executor runs them."""
        weights = [p for p in layer.parameters() if p.requires_grad]
        start = now()
        with torch.enable_grad():
            y = layer(x)
        forward = now() - start
        if not y.requires_grad:
            return y, forward, 0.0, 0.0
        g = torch.ones_like(y)
        mid = now()
        if x.requires_grad:
            torch.autograd.grad(y, x, g, retain_graph=True, allow_unused=True)
        done_i = now()
        if weights:
            torch.autograd.backward(y, g, inputs=weights)
        return y, forward, done_i - mid, now() - done_i

    timed = best_per_layer(model, sample, split_backward, repeat)
    forward, input_grad, weight_grad = ([t[i] for t in timed] for i in range(3))
    # Saved bytes are storages, counted once: a ReLU saves its output and the next Linear saves
    # the same tensor as its input (the executor's ledger counts it once too). So each layer's
    # count leaves out its input's storage (the stage input is counted on its own, or the layer
    # before saved it) unless the layer before did not save it (saved_input), and the output's
    # storage when not saved is what a stage's stash keeps of its last layer anyway (unsaved_output).
    saved_input, unsaved_output, saved_out_before = [], [], False
    x = sample
    for layer in model:
        x = x.detach().requires_grad_(x.is_floating_point())
        weights = list(layer.parameters())
        with SavedBytes(weights) as counted, torch.enable_grad():
            y = layer(x)
        mine, theirs = _storage(y), _storage(x)
        out_bytes = float(y.numel() * y.element_size())
        saved.append(float(sum(b for ptr, b in counted.tensors.items() if ptr != theirs)))
        saved_input.append(float(counted.tensors[theirs]) if theirs in counted.tensors and not saved_out_before else 0.0)
        saved_out_before = mine in counted.tensors
        unsaved_output.append(0.0 if saved_out_before else out_bytes)
        output.append(out_bytes)
        params.append(float(sum(p.numel() * p.element_size() for p in weights)))
        sizes.append([p.numel() * p.element_size() for p in weights if p.requires_grad])
        x = y
    model.zero_grad(set_to_none=True)
    return LayerProfile(seconds, saved, output, params, float(sample.numel() * sample.element_size()),
                        forward, input_grad, weight_grad, sizes, saved_input=saved_input, unsaved_output=unsaved_output)  # fmt: skip


def loss_saved_bytes(model, sample, loss) -> float:
    """The bytes ``loss`` saves for its backward on ``model``'s output for ``sample``, beyond that
    output itself (cross-entropy keeps its log-softmax, as large as the logits)."""
    with torch.enable_grad():
        y = model(sample)
        with SavedBytes([y]) as counted:
            loss(y)
    model.zero_grad(set_to_none=True)
    return float(counted.nbytes)


def _storage(t) -> int:
    return t.untyped_storage().data_ptr() if t.numel() else 0
