"""The ZeRO memory model: bytes per rank of parameters, gradients and optimizer state by stage.

Pure functions. After Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion
Parameter Models" (SC 2020), section 5 and figure 1: with Psi parameters, N ranks, and bytes per
parameter ``p`` (parameters), ``g`` (gradients) and ``K`` (optimizer state), one rank holds

- stage 0 (replicated, DDP):  (p + g + K) Psi
- stage 1 (optimizer state):  (p + g) Psi + K Psi / N
- stage 2 (+ gradients):      p Psi + (g + K) Psi / N
- stage 3 (+ parameters):     (p + g + K) Psi / N

Mixed-precision Adam is p = g = 2 (fp16) and K = 12 (fp32 master parameters, momentum,
variance); plain fp32 Adam is p = g = 4 and K = 8 (its two moments; the parameter is its own
master copy). The paper's example, Psi = 7.5e9 and N = 64 in mixed precision: 120, 31.4, 16.6
and 1.9 GB.

:func:`bucket_memory` adds what the model leaves out for a concrete bucket layout: the padding,
the gathered buckets a stage-3 rank holds while ``prefetch`` all-gathers are in flight, and the
full gradient bucket a reduce-scatter reads from.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from commlab.runs.zero_stage import parse_stage

# (parameter, gradient, optimizer-state) bytes per parameter, with Adam's state.
PRECISIONS = {"mixed": (2, 2, 12), "fp32": (4, 4, 8)}


@dataclass(frozen=True)
class StageMemory:
    """Bytes one rank holds, by kind."""

    parameters: float
    gradients: float
    optimizer: float

    @property
    def total(self) -> float:
        return self.parameters + self.gradients + self.optimizer


def zero_memory(
    num_params: float, world_size: int, stage: int, precision: str = "mixed", optimizer_bytes: float | None = None
) -> StageMemory:
    """The ZeRO model for one rank (this module's docstring); ``optimizer_bytes`` overrides K
    (e.g. 4 for SGD with momentum in fp32, 0 for plain SGD)."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {sorted(PRECISIONS)}, got {precision!r}")
    zero = parse_stage(stage)
    if world_size < 1:
        raise ValueError(f"world_size must be positive, got {world_size}")
    if num_params < 0:
        raise ValueError(f"num_params must not be negative, got {num_params}")
    p, g, k = PRECISIONS[precision]
    if optimizer_bytes is not None:
        if optimizer_bytes < 0:
            raise ValueError(f"optimizer_bytes must not be negative, got {optimizer_bytes}")
        k = optimizer_bytes
    n = world_size
    return StageMemory(
        parameters=num_params * p / (n if zero.parameters else 1),
        gradients=num_params * g / (n if zero.gradients else 1),
        optimizer=num_params * k / (n if zero.optimizer_state else 1),
    )


@dataclass(frozen=True)
class BucketMemory:
    """The transient terms of a concrete bucket layout, bytes per rank.

    ``gathered``: full (padded) parameter buckets held at once besides what the model counts: at
    stage 3 the bucket in use plus ``prefetch`` buckets being gathered ahead, plus one more for the
    copy-out (an all-gather's rank-major buffer and the parameters it is copied into coexist); at
    stages 1-2, which keep the replica, the rank-major buffers of the ``1 + prefetch`` all-gathers
    in flight after a step. The largest buckets: an upper bound. ``reduce_scatter``: the full gradient buckets held at once (stages 2 and 3): the one a
    reduce-scatter reads from and the next one filling, as the engine keeps one reduce-scatter in
    flight (torch's fully_shard default); the two largest, an upper bound. Stage 1 keeps every
    gradient bucket, which the model counts already.
    ``padding``: what padding adds to the sharded terms of the model (the replica and stage 1's
    gradient buffer are unpadded).
    """

    gathered: int
    reduce_scatter: int
    padding: int


def bucket_memory(
    padded_numels: Sequence[int],
    world_size: int,
    stage: int,
    prefetch: int,
    element_size: int = 4,
    optimizer_bytes: int = 8,
    unpadded_numels: Sequence[int] | None = None,
) -> BucketMemory:
    """Transient and padding bytes for buckets of these padded sizes (see :class:`BucketMemory`)."""
    if prefetch < 0:
        raise ValueError(f"prefetch must not be negative, got {prefetch}")
    zero = parse_stage(stage)
    if zero.ddp:
        raise ValueError("bucket_memory is for stages 1-3 (stage 0, DDP, has no sharded buckets)")
    sizes = sorted((int(n) for n in padded_numels), reverse=True)
    window = sum(sizes[: prefetch + 1])
    gathered = (window + sizes[0] if zero.parameters else window) * element_size
    reduce_scatter = sum(sizes[:2]) * element_size if zero.gradients else 0
    pad = sum(padded_numels) - (sum(unpadded_numels) if unpadded_numels is not None else sum(padded_numels))
    # Padding elements are sharded like the rest: per rank, pad / N of each sharded kind.
    per_rank_pad = pad / world_size
    params, grads = (element_size if zero.parameters else 0), (element_size if zero.gradients else 0)
    sharded = optimizer_bytes + grads + params
    return BucketMemory(gathered, reduce_scatter, int(round(per_rank_pad * sharded)))
