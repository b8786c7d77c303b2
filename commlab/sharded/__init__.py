"""Sharded data parallelism (ZeRO stages 1-3) on commlab's flat buckets.

Package map: ``layout`` (where parameters lie in a flat padded bucket and its shards, pure),
``memory_model`` (the ZeRO memory model, pure), ``buckets`` (which parameters share a bucket),
``flat_bucket`` (one bucket's buffers and collectives), ``engine`` (the step's life cycle: hooks,
gathers, frees, reductions), ``comm`` (the collectives), ``timing``, ``memory`` (live bytes),
``state`` (full module state dicts), ``optim_state`` (the full optimizer state dict),
``validate`` (argument and optimizer checks), ``distributed`` (the
public wrapper).

How commlab's stage 3 differs from torch's ``fully_shard`` (FSDP2,
torch/distributed/fsdp/_fully_shard): torch shards every parameter on its own along dim 0, as a
DTensor (``Shard(0)``) that the optimizer sees in the parameter's shape, and copies a unit's
shards into one buffer only for the all-gather. commlab lays a bucket's parameters end to end in
one flat buffer, pads it to a multiple of the world size and gives each rank one contiguous 1-D
piece (ZeRO's and torch's FSDP1 layout): one all-gather and one reduce-scatter per bucket with no
copy-in or copy-out, any bucket size independent of module boundaries, and padding at most
world_size - 1 elements per bucket, not per parameter. What follows: a rank's shard cuts
parameters at arbitrary points and holds pieces of several, so an optimizer that needs a whole
parameter (per-parameter norms as in LAMB or LARS, Adafactor's row and column factors, Muon's
orthogonalisation, LBFGS) is not supported; torch's such optimizers are refused at their first
step, others cannot be recognised. Element-wise optimizers (SGD with momentum, Adam, AdamW) give
the parameters torch's DDP gives, and the same state dict.
"""

from commlab.sharded.distributed import ShardedDataParallel
from commlab.sharded.memory import ShardedMemory
from commlab.sharded.memory_model import StageMemory, bucket_memory, zero_memory
from commlab.sharded.timing import CollectiveTiming, ShardedIterationTiming

__all__ = [
    "CollectiveTiming",
    "ShardedDataParallel",
    "ShardedIterationTiming",
    "ShardedMemory",
    "StageMemory",
    "bucket_memory",
    "zero_memory",
]
