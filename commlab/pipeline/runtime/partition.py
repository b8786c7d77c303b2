"""Partitioning an nn.Sequential into stages: by a balance list, by profiled time, or by size.

The split that minimises the slowest stage is a pure function of per-layer costs
(:func:`partition`): the classic linear-partition dynamic programme that torchgpipe's balance and
PipeDream's partitioner also solve. Profiling only produces the costs.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch
    from torch import nn

# torch loads inside the functions that use it: ``partition`` itself is pure, and importing
# commlab.pipeline (the CLI's help included) should not cost torch's import time.


def check_balance(balance: Sequence[int], layers: int) -> list[int]:
    balance = [int(b) for b in balance]
    if not balance or any(b < 1 for b in balance):
        raise ValueError(f"balance must be positive layer counts, one per stage, got {balance}")
    if sum(balance) != layers:
        raise ValueError(f"balance {balance} sums to {sum(balance)}, but the model has {layers} layers")
    return balance


def split(model: nn.Sequential, balance: Sequence[int]) -> list[nn.Sequential]:
    """Cut ``model`` into consecutive ``nn.Sequential`` stages of ``balance[s]`` layers each.

    The stages share the model's layers (no copy), so parameters and their ``.grad`` are the
    model's own.
    """
    from torch import nn  # lazy: see the module's imports

    if not isinstance(model, nn.Sequential):
        raise ValueError(f"a pipeline partitions an nn.Sequential, got {type(model).__name__}")
    balance = check_balance(balance, len(model))
    layers = list(model.children())
    stages, start = [], 0
    for count in balance:
        stages.append(nn.Sequential(*layers[start : start + count]))
        start += count
    return stages


def partition(costs: Sequence[float], parts: int) -> list[int]:
    """Layer counts per stage minimising the largest stage cost (contiguous stages, each >= 1 layer).

    O(n^2 k) dynamic programme over prefix sums; among equally good splits the earliest cut wins,
    which gives the extra layer of an uneven split to the later stages.
    """
    n = len(costs)
    if parts < 1 or parts > n:
        raise ValueError(f"cannot split {n} layers into {parts} stages of at least one layer")
    if any(c < 0 for c in costs):
        raise ValueError("layer costs must be non-negative")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + float(c))
    inf = float("inf")
    # best[k][j]: the smallest possible slowest stage when the first j layers form k stages.
    best = [[inf] * (n + 1) for _ in range(parts + 1)]
    cut = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = 0.0
    for k in range(1, parts + 1):
        for j in range(k, n - (parts - k) + 1):
            for i in range(k - 1, j):
                value = max(best[k - 1][i], prefix[j] - prefix[i])
                if value < best[k][j] - 1e-12:
                    best[k][j], cut[k][j] = value, i
    counts, j = [], n
    for k in range(parts, 0, -1):
        counts.append(j - cut[k][j])
        j = cut[k][j]
    return counts[::-1]


def best_per_layer(model: nn.Sequential, sample: torch.Tensor, measure: Callable, repeat: int = 3) -> list[tuple[float, ...]]:
    """Per layer, the element-wise best (minimum) over ``repeat`` passes of ``measure(layer, x)``.

    ``measure`` runs one layer on its input ``x`` (a detached leaf, requiring grad when floating
    point, so each layer's backward stops at its own input) and returns ``(output, seconds...)``;
    the output feeds the next layer. Gradients it leaves on the model are cleared at the end."""
    best: list[tuple[float, ...]] = [()] * len(model)
    for _ in range(max(1, repeat)):
        x = sample
        for k, layer in enumerate(model):
            x = x.detach().requires_grad_(x.is_floating_point())
            x, *seconds = measure(layer, x)
            best[k] = tuple(map(min, best[k], seconds)) if best[k] else tuple(seconds)
    model.zero_grad(set_to_none=True)
    return best


def profile_times(model: nn.Sequential, sample: torch.Tensor, repeat: int = 3) -> list[float]:
    """Per layer, the best-of-``repeat`` forward + backward wall time on ``sample`` (seconds)."""

    import torch  # lazy: see the module's imports

    def forward_backward(layer: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, float]:
        sync = torch.cuda.synchronize if x.is_cuda else (lambda: None)
        sync()
        start = time.perf_counter()
        y = layer(x)
        if y.requires_grad:
            y.backward(torch.ones_like(y))
        sync()
        return y, time.perf_counter() - start

    return [seconds for (seconds,) in best_per_layer(model, sample, forward_backward, repeat)]


def profile_sizes(model: nn.Sequential, sample: torch.Tensor) -> list[float]:
    """Per layer, parameter bytes plus activation bytes it saves for backward on ``sample``."""
    from commlab.pipeline.runtime.memory import SavedBytes  # needs torch: lazy, see the module's imports

    sizes = []
    x = sample
    for layer in model:
        x = x.detach().requires_grad_(x.is_floating_point())
        params = list(layer.parameters())
        with SavedBytes(params) as saved:
            y = layer(x)
        sizes.append(float(saved.nbytes + sum(p.numel() * p.element_size() for p in params)))
        x = y
    return sizes


def balance_by_time(model: nn.Sequential, sample: torch.Tensor, parts: int, repeat: int = 3) -> list[int]:
    """The balance minimising the slowest stage's profiled forward + backward time."""
    return partition(profile_times(model, sample, repeat), parts)


def balance_by_size(model: nn.Sequential, sample: torch.Tensor, parts: int) -> list[int]:
    """The balance minimising the largest stage's parameter + activation bytes."""
    return partition(profile_sizes(model, sample), parts)
