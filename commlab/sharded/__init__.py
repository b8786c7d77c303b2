"""Sharded data parallelism (ZeRO stages 1-3) on commlab's flat buckets.

Package map: ``layout`` (each parameter's rows per rank and a bucket's rank-major buffer, pure),
``copies`` (copy-in and copy-out between parameters and that buffer), ``dparams`` (the model's
parameters as DTensor shards, swapped for whole tensors around a forward), ``memory_model`` (the
ZeRO memory model, pure), ``buckets`` (which parameters share a bucket), ``flat_bucket`` (one
bucket's buffers and collectives), ``engine`` (the step's life cycle: hooks, gathers, frees,
reductions), ``comm`` (the collectives), ``timing``, ``memory`` (live bytes), ``state`` (full state:
a module state dict loaded, the optimizer's gathered), ``arguments`` (argument and
optimizer checks), ``precision`` (mixed precision), ``hybrid`` (HSDP: the reduction across
replicas), ``ordering`` (collectives every rank agrees on), ``backward`` (the engine's backward
half), ``join`` (uneven inputs), ``peak_model`` (a step's peak by phase and dtype), ``distributed``
(the public wrapper).

The parameters are torch's ``fully_shard`` (FSDP2) parameters: each a DTensor ``Shard(0)``
holding the rank's rows (torch/distributed/fsdp/_fully_shard/_fsdp_param.py), so optimizers,
parameter groups, gradient clipping and GradScaler see whole parameters; the collectives run
per bucket (a size cap or ``units``) on commlab's own algorithms, with copies in and out as
fully_shard's (commlab/sharded/copies.py). Where commlab differs: stages 1-2 keep a replica, and
buckets may follow a size cap, which fully_shard's units cannot.
"""

from commlab.sharded.distributed import ShardedDataParallel
from commlab.sharded.memory import ShardedMemory, track_memory
from commlab.sharded.memory_model import StageMemory, bucket_memory, mixed_precision_memory, zero_memory
from commlab.sharded.peak_model import PeakMemory, sharded_peak
from commlab.sharded.precision import MixedPrecision
from commlab.sharded.timing import CollectiveTiming, ShardedIterationTiming

__all__ = [
    "CollectiveTiming",
    "MixedPrecision",
    "PeakMemory",
    "ShardedDataParallel",
    "ShardedIterationTiming",
    "ShardedMemory",
    "StageMemory",
    "bucket_memory",
    "mixed_precision_memory",
    "sharded_peak",
    "track_memory",
    "zero_memory",
]
