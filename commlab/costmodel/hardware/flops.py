"""A workload's compute from its FLOPs at a stated fraction of a device's peak: no device needed.

For what-if predictions on hardware nobody here has (``commlab predict --hardware``) when no
calibration made on such a device is given. torch.utils.flop_counter counts the model's
forward and forward+backward FLOPs on the meta device (shapes only: no weights allocated, no
compute run); time = FLOPs / (fraction x peak). A gradient's ready time in backward is its
module's share of the backward FLOPs, in reverse module order (the order autograd reaches the
parameters of a model that runs its modules in registration order); a module's FLOPs are its
own, less its children's, split between its parameters by size. Every such figure is labelled
with these assumptions (:func:`describe`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.utils.flop_counter import FlopCounterMode, conv_flop_count

from commlab.costmodel.terms.costs import DDPProfile
from commlab.models import build_workload


@dataclass(frozen=True)
class Flops:
    """What one rank's step computes, in FLOPs, and each parameter's share of the backward."""

    forward: float
    backward: float
    share: tuple[float, ...]  # per parameter (module order), summing to 1
    param_nbytes: tuple[int, ...]


def count(model_name: str, model_kwargs: dict, batch_per_rank: int) -> Flops:
    """Count a workload's FLOPs on the meta device."""
    with torch.device("meta"):
        workload = build_workload(model_name, **model_kwargs)
    model = workload.model
    inputs, target = workload.make_batch(batch_per_rank, torch.Generator().manual_seed(0))
    inputs, target = inputs.to("meta"), target.to("meta")
    with FlopCounterMode(display=False, custom_mapping=CORRECTED) as forward_only:
        model(inputs)
    with FlopCounterMode(display=False, custom_mapping=CORRECTED) as both:
        workload.loss_fn(model(inputs), target).backward()
    forward = float(forward_only.get_total_flops())
    params = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    return Flops(forward, float(both.get_total_flops()) - forward,
                 _shares(model, params, forward_only.get_flop_counts()),
                 tuple(p.numel() * p.element_size() for _, p in params))


def _conv_backward(grad_out_shape, x_shape, w_shape, _bias, _stride, _padding, _dilation, transposed,
                   _output_padding, _groups, output_mask, out_shape=None, **_kwargs) -> int:
    """A convolution's backward: each gradient asked for (input, weight) does the forward's
    multiply-adds. torch's own formula (torch/utils/flop_counter.py conv_backward_flop, torch 2.13)
    counts the weight gradient of a grouped convolution as if it were not grouped, ``groups`` times
    its work (5.6x ResNeXt101-32x8d's forward for its backward instead of 2x)."""
    forward = conv_flop_count(x_shape, w_shape, grad_out_shape, transposed)
    return forward * (int(bool(output_mask[0])) + int(bool(output_mask[1])))


CORRECTED = {torch.ops.aten.convolution_backward: _conv_backward}


def _shares(model: torch.nn.Module, params, counts) -> tuple[float, ...]:
    root = type(model).__name__
    total = {name: float(sum(c.values())) for name, c in counts.items()}

    def key(module_path: str) -> str:
        return f"{root}.{module_path}" if module_path else root

    owned: dict[str, list[int]] = {}
    for i, (name, _) in enumerate(params):
        owned.setdefault(name.rpartition(".")[0], []).append(i)
    weights = [0.0] * len(params)
    for path, module in model.named_modules():
        children = sum(total.get(key(f"{path}.{c}" if path else c), 0.0) for c, _ in module.named_children())
        own = max(total.get(key(path), 0.0) - children, 0.0)
        members = owned.get(path, [])
        size = sum(params[i][1].numel() for i in members)
        for i in members:
            weights[i] += own * params[i][1].numel() / size if size else 0.0
    whole = sum(weights)
    if whole <= 0:  # nothing counted (no matmul or convolution): by size
        sizes = [p.numel() for _, p in params]
        return tuple(s / sum(sizes) for s in sizes)
    return tuple(w / whole for w in weights)


def profile(flops: Flops, flops_per_s: float, *, optimizer_s: float = 0.0) -> DDPProfile:
    """The DDP profile of a device computing at ``flops_per_s`` (peak x the stated fraction)."""
    if not flops_per_s > 0:
        raise ValueError(f"flops_per_s must be positive, got {flops_per_s}")
    n = len(flops.share)
    order = tuple(reversed(range(n)))
    ready, elapsed = [], 0.0
    for p in order:
        elapsed += flops.backward * flops.share[p] / flops_per_s
        ready.append(elapsed)
    forward = flops.forward / flops_per_s
    return DDPProfile(forward_s=forward, ready_s=tuple(ready), ready_order=order, param_nbytes=flops.param_nbytes,
                      optimizer_s=optimizer_s, nosync_s=forward + elapsed)


def describe(flops: Flops, peak_flops: float, fraction: float, batch_per_rank: int) -> str:
    return (f"compute from FLOPs (torch.utils.flop_counter): {flops.forward / 1e9:.1f} GFLOP forward + "
            f"{flops.backward / 1e9:.1f} GFLOP backward per rank at batch {batch_per_rank}, run at {fraction:.0%} "
            f"(ASSUMED) of a {peak_flops / 1e12:.0f} TFLOP/s peak")
