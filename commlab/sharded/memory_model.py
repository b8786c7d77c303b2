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
the rank-major buffers of the all-gathers in flight, and the full gradient buckets a reduce-scatter
reads from. They are not all held at once: stages 1-2 gather after the optimizer step, when
neither activations nor a gradient bucket being filled exist (``after_step``), stage 3 gathers
in forward and backward beside them (``gathered``).
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


def sharded_over(world_size: int, shard: int | None) -> int:
    """The N that divides the sharded terms: the shard group's size under hybrid sharding (HSDP,
    commlab/sharded/hybrid.py: shards of 1/shard, replicated across world_size / shard replicas),
    else the world size."""
    if world_size < 1:
        raise ValueError(f"world_size must be positive, got {world_size}")
    if shard is None:
        return world_size
    if isinstance(shard, bool) or not isinstance(shard, int) or shard < 1 or world_size % shard:
        raise ValueError(f"shard must be a positive divisor of world_size {world_size}, got {shard!r}")
    return shard


def zero_memory(
    num_params: float, world_size: int, stage: int, precision: str = "mixed", optimizer_bytes: float | None = None,
    shard: int | None = None,
) -> StageMemory:
    """The ZeRO model for one rank (this module's docstring); ``optimizer_bytes`` overrides K
    (e.g. 4 for SGD with momentum in fp32, 0 for plain SGD); ``shard``: HSDP's shard group size."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {sorted(PRECISIONS)}, got {precision!r}")
    zero = parse_stage(stage)
    n = sharded_over(world_size, shard)
    if num_params < 0:
        raise ValueError(f"num_params must not be negative, got {num_params}")
    p, g, k = PRECISIONS[precision]
    if optimizer_bytes is not None:
        if optimizer_bytes < 0:
            raise ValueError(f"optimizer_bytes must not be negative, got {optimizer_bytes}")
        k = optimizer_bytes
    return StageMemory(
        parameters=num_params * p / (n if zero.parameters else 1),
        gradients=num_params * g / (n if zero.gradients else 1),
        optimizer=num_params * k / (n if zero.optimizer_state else 1),
    )


def mixed_precision_memory(
    num_params: float, world_size: int, stage: int, optimizer_bytes: float = 8, param_bytes: int = 2,
    reduce_bytes: int = 4, master_bytes: int = 4, shard: int | None = None,
) -> StageMemory:
    """What a rank holds under ``mixed_precision`` (commlab/sharded/precision.py, torch's
    ``fully_shard`` likewise), by the dtypes' sizes: ``param_bytes`` (the computation's),
    ``reduce_bytes`` (the reduction's), ``master_bytes`` (the shards the optimizer steps, with
    ``optimizer_bytes`` of state beside them). The paper's mixed-precision K = 12 is
    ``master_bytes + optimizer_bytes`` for Adam; unlike the paper, no 16-bit copy of the
    parameters is kept at stage 3 (the master shard is cast for each gather) and the gradient
    shard is in the master's dtype, so stage 3 holds the paper's 16 Psi / N for Adam, stage 2
    (reduce_bytes - 2) Psi / N more, and stage 1 keeps the reduced full gradient in the
    reduction's dtype (plus a master-dtype copy of its rows when the two differ)."""
    zero = parse_stage(stage)
    if zero.ddp:
        raise ValueError("mixed_precision_memory is for stages 1-3 (ShardedDataParallel's)")
    n, m = sharded_over(world_size, shard), master_bytes
    master = num_params * m / n
    if zero.parameters:
        params = master
    else:  # the compute replica, beside the master rows where its dtype is another
        params = num_params * param_bytes + (master if param_bytes != m else 0)
    if zero.gradients:
        grads = master
    else:
        grads = num_params * reduce_bytes + (master if reduce_bytes != m else 0)
    return StageMemory(params, grads, num_params * optimizer_bytes / n)


@dataclass(frozen=True)
class BucketMemory:
    """The transient terms of a concrete bucket layout, bytes per rank.

    ``gathered`` (stage 3): full (padded) parameter buckets held in forward and backward besides
    what the model counts: the bucket in use plus ``prefetch`` buckets being gathered ahead. (The
    copy-out briefly holds a bucket twice, its rank-major buffer and its parameters, but that
    buffer is gone before the bucket's gradients arrive, which the reduce-scatter term counts.)
    ``after_step`` (stages 1-2, which keep the replica and gather
    right after the optimizer step, commlab/sharded/engine.py step 6): the rank-major buffers of
    the ``1 + prefetch`` all-gathers then in flight, and, for an algorithm that needs an input of
    its own (``input_copy``: the backend's all-gather, whose input must not alias its output,
    commlab/sharded/flat_bucket.py launch_gather), a shard-sized copy for each. With ``staged``
    (Gloo's all-gather, which gathers into a flat tensor of its own and then copies it out:
    measured, docs/measurements.md) every all-gather in flight holds its bucket once more. The
    largest buckets: an upper bound.
    ``reduce_scatter``: the full gradient buckets held at once (stages 2 and 3): the one a
    reduce-scatter reads from and the next one filling, as the engine keeps one reduce-scatter in
    flight (torch's fully_shard default); the two largest, an upper bound. Stage 1 keeps every
    gradient bucket, which the model counts already.
    ``padding``: what padding adds to the sharded terms of the model for the rank holding the most
    rows (rank 0 holds a full padded piece of every parameter; the replica is unpadded).
    """

    gathered: int
    reduce_scatter: int
    padding: int
    after_step: int = 0


def bucket_memory(
    padded_numels: Sequence[int],
    world_size: int,
    stage: int,
    prefetch: int,
    element_size: int = 4,
    optimizer_bytes: int = 8,
    unpadded_numels: Sequence[int] | None = None,
    input_copy: bool = True,
    staged: bool = False,
    shard: int | None = None,
) -> BucketMemory:
    """Transient and padding bytes for buckets of these padded sizes (see :class:`BucketMemory`);
    ``shard``: HSDP's shard group size, over which the buckets are padded and sharded."""
    world_size = sharded_over(world_size, shard)
    if prefetch < 0:
        raise ValueError(f"prefetch must not be negative, got {prefetch}")
    zero = parse_stage(stage)
    if zero.ddp:
        raise ValueError("bucket_memory is for stages 1-3 (stage 0, DDP, has no sharded buckets)")
    sizes = sorted((int(n) for n in padded_numels), reverse=True)
    window = sum(sizes[: prefetch + 1])
    # Staged, a gather in flight holds its buffer and Gloo's; once waited for, the buffer and the
    # parameters it is copied into. Stage 3's bucket in use is done with both, so its gradients
    # arrive beside the ``prefetch`` gathers ahead (at most the largest): those hold twice.
    # Stages 1-2 launch all 1 + prefetch at once after the step.
    ahead = sum(sizes[:prefetch]) if staged else 0
    gathered = (window + ahead) * element_size if zero.parameters else 0
    staging = window if staged else 0
    after_step = 0 if zero.parameters else (window + staging + (window // world_size if input_copy else 0)) * element_size
    reduce_scatter = sum(sizes[:2]) * element_size if zero.gradients else 0
    pad = sum(padded_numels) - (sum(unpadded_numels) if unpadded_numels is not None else sum(padded_numels))
    # Padding elements are sharded like the rest: per rank, pad / N of each sharded kind.
    per_rank_pad = pad / world_size
    params, grads = (element_size if zero.parameters else 0), (element_size if zero.gradients else 0)
    sharded = optimizer_bytes + grads + params
    return BucketMemory(gathered, reduce_scatter, int(round(per_rank_pad * sharded)), after_step)


# Parameter-sized temporaries an optimizer's step holds at once, by its state bytes per parameter
# (commlab/runs/optimizers.py's K), on torch's single-tensor path (its default for CPU tensors):
# Adam and AdamW (8) hold 3 of the largest tensor, the square root of the second moment, its
# quotient by the bias correction and one more inside the update (torch/optim/adam.py's
# _single_tensor_adam; measured with commlab.memtrack on plain tensors and DTensor shards alike,
# docs/measurements.md, 2026-11-27 14:48-15:20 UTC); SGD with or without momentum (4, 0) updates
# in place. Other implementations (foreach, fused): commlab/sharded/peak_model.py.
STEP_TEMPORARIES = {0: 0, 4: 0, 8: 3}


def step_temporaries(optimizer_bytes: float) -> int:
    """How many temporaries of the largest parameter (or of its shard) the optimizer's step holds."""
    return STEP_TEMPORARIES.get(int(optimizer_bytes), 0)
