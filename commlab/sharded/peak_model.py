"""The peak bytes of one sharded step: what a rank holds, plus the largest of its phases' transients,
each counted in the dtype it is allocated in.

Pure functions. The held bytes are :func:`commlab.sharded.memory_model.mixed_precision_memory`'s
(parameters, gradients and optimizer state, every dtype as ``ShardedDataParallel`` keeps it;
without a policy all three sizes are the parameters'). A step passes three phases, each with
transients of its own on top of them (commlab/sharded/engine.py numbers the steps):

- backward (steps 3-5): stage 3's gathered buckets in the computation's dtype (the bucket in use
  and ``prefetch`` ahead, each held once more by Gloo's staging while in flight,
  :func:`~commlab.sharded.memory_model.bucket_memory`); stages 2-3's full gradient buckets in the
  reduction's dtype (the one being reduce-scattered and the next one filling); and autograd's
  gradient of one parameter in the computation's dtype, alive until the hook has copied it into
  its bucket. Stage 1's gradient buckets are held bytes already.
- the optimizer's step: its temporaries over the master shards (:data:`OPTIMIZER_TEMPORARIES`).
- after the step (stages 1-2, step 6): the ``1 + prefetch`` all-gathers in flight, in the
  computation's dtype (the rank-major buffer, Gloo's staging copy and the input copy of a backend
  all-gather).

The held gradients are counted in every phase: they exist from the end of backward until
``zero_grad``, which the usual loop calls after the step's all-gathers are launched. Left out,
each under 1/N of a bucket: the reduce-scatter's output shard before its cast to the master dtype,
stage 3's cast of its shard for the gather, activations (a parameter-dominated model's are small).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from commlab.runs.zero_stage import parse_stage
from commlab.sharded.memory_model import bucket_memory, mixed_precision_memory, step_temporaries

# Tensors of a parameter's (here: a master shard's) size that Adam's step holds at once, by
# implementation, measured with commlab.memtrack on torch 2.13 CPU (docs/measurements.md,
# 2026-11-27 14:48-15:20 UTC), the same for plain tensors and DTensor shards:
# - "for_loop" (torch's single-tensor path, its default for CPU tensors): ``step_temporaries(8)``
#   of the largest tensor (commlab/sharded/memory_model.py says which).
# - "foreach" (the multi-tensor path, torch's default for CUDA tensors): one temporary for every
#   tensor at once (its ``_foreach_sqrt`` result over the whole list).
# - "fused": none (one kernel updates in place).
OPTIMIZER_TEMPORARIES = {"for_loop": "largest", "foreach": "all", "fused": "none"}


def optimizer_temporaries(shard_numels: Sequence[int], element_size: int, implementation: str = "for_loop") -> int:
    """Bytes of the optimizer step's temporaries over tensors of these sizes (an Adam step;
    an optimizer without state holds none, which the caller decides)."""
    kind = OPTIMIZER_TEMPORARIES.get(implementation)
    if kind is None:
        raise ValueError(f"implementation must be one of {sorted(OPTIMIZER_TEMPORARIES)}, got {implementation!r}")
    if kind == "largest":
        return step_temporaries(8) * max(shard_numels, default=0) * element_size
    return sum(shard_numels) * element_size if kind == "all" else 0


@dataclass(frozen=True)
class PeakMemory:
    """Bytes one rank holds, and the transients of each phase on top of them."""

    held: float
    backward: int
    step: int
    after_step: int

    @property
    def peak(self) -> float:
        return self.held + max(self.backward, self.step, self.after_step)


def sharded_peak(
    padded_numels: Sequence[int],
    largest_param: int,
    world_size: int,
    stage: int,
    prefetch: int = 1,
    *,
    param_bytes: int = 4,
    reduce_bytes: int = 4,
    master_bytes: int = 4,
    optimizer_bytes: float = 8,
    optimizer: str | None = "for_loop",
    unpadded_numels: Sequence[int] | None = None,
    staged: bool = True,
    input_copy: bool = True,
) -> PeakMemory:
    """The peak of one step (module docstring) for buckets of these padded sizes, whose largest
    parameter has ``largest_param`` elements; ``optimizer`` the Adam implementation (None: an
    optimizer without temporaries). ``staged`` and ``input_copy`` as for ``bucket_memory``:
    Gloo's all-gather (``algorithm="native"`` on Gloo) stages and needs its own input."""
    zero = parse_stage(stage)
    unpadded = list(unpadded_numels) if unpadded_numels is not None else list(padded_numels)
    held = mixed_precision_memory(sum(unpadded), world_size, stage, optimizer_bytes, param_bytes, reduce_bytes,
                                  master_bytes).total
    common = {"unpadded_numels": unpadded, "input_copy": input_copy, "staged": staged}
    gathers = bucket_memory(padded_numels, world_size, stage, prefetch, param_bytes, **common)
    reductions = bucket_memory(padded_numels, world_size, stage, prefetch, reduce_bytes, **common)
    # Padding adds to the sharded kinds, which are in the master dtype (parameters at stage 3 or
    # under a policy, gradients from stage 2, optimizer state always).
    padding = bucket_memory(padded_numels, world_size, stage, prefetch, master_bytes, int(optimizer_bytes),
                            **common).padding
    backward = (gathers.gathered if zero.parameters else 0) + reductions.reduce_scatter + largest_param * param_bytes
    shards = [n // world_size for n in padded_numels]
    step = optimizer_temporaries(shards, master_bytes, optimizer) if optimizer is not None else 0
    return PeakMemory(held + padding, backward, step, gathers.after_step)
