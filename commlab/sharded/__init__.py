"""Sharded data parallelism (ZeRO stages 1-3) on commlab's flat buckets.

Package map: ``layout`` (where parameters lie in a flat padded bucket and its shards, pure),
``memory_model`` (the ZeRO memory model, pure), ``buckets`` (which parameters share a bucket),
``flat_bucket`` (one bucket's buffers and collectives), ``engine`` (the step's life cycle: hooks,
gathers, frees, reductions), ``comm`` (the collectives), ``timing``, ``memory`` (live bytes),
``state`` (full module state dicts), ``optim_state`` (the full optimizer state dict),
``arguments`` (argument and optimizer checks), ``distributed`` (the public wrapper).

How commlab's stage 3 differs from torch's ``fully_shard`` (FSDP2,
torch/distributed/fsdp/_fully_shard): torch shards every parameter on its own along dim 0, as a
DTensor (``Shard(0)``, each parameter padded to a multiple of the world size) that the optimizer
sees in the parameter's own shape; for each collective it copies a unit's shards into one buffer
and back out (copy-in and copy-out around the all-gather, a copy into a flat buffer before the
reduce-scatter). commlab lays a bucket's parameters end to end in one flat buffer, pads the
bucket (not each parameter) to a multiple of the world size and gives each rank one contiguous
1-D piece (ZeRO's and torch's FSDP1 layout): the parameters are views into the gathered buffer,
so the all-gather writes them in place with no copy-out; gradients are copied into the bucket
as DDP copies them; a bucket may follow module boundaries (``units``, like fully_shard's) or a
size limit (DDP's assignment), which fully_shard cannot. What follows: a rank's shard cuts
parameters at arbitrary points and holds pieces of several, so an optimizer that needs a whole
parameter (per-parameter norms as in LAMB or LARS, Adafactor's row and column factors, Muon's
orthogonalisation, LBFGS) is not supported; torch's such optimizers are refused at their first
step, others cannot be recognised. Element-wise optimizers (SGD with momentum, Adam, AdamW) give
the parameters torch's DDP gives, and the same state dict.
"""

from commlab.sharded.distributed import ShardedDataParallel
from commlab.sharded.memory import ShardedMemory, track_memory
from commlab.sharded.memory_model import StageMemory, bucket_memory, zero_memory
from commlab.sharded.timing import CollectiveTiming, ShardedIterationTiming

__all__ = [
    "CollectiveTiming",
    "ShardedDataParallel",
    "ShardedIterationTiming",
    "ShardedMemory",
    "StageMemory",
    "bucket_memory",
    "track_memory",
    "zero_memory",
]
