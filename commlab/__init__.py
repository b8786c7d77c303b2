"""commlab: see and tune the communication of data- and pipeline-parallel training in PyTorch.

Public API (everything else is internal):

- ``commlab.launch`` / ``commlab.Runtime`` / ``commlab.init_from_env``: ranks and process groups;
- ``commlab.DistributedDataParallel``: torch's DDP, bucketed and overlapped in readable Python;
- ``commlab.ShardedDataParallel``: ZeRO stages 1-3 on flat padded buckets (torch's ``fully_shard``'s results);
- ``commlab.collectives``: ring, tree and halving-doubling all-reduce on point-to-point ops;
- ``commlab.pipeline``: GPipe, 1F1B and interleaved pipeline schedules;
- ``commlab.tensor``: tensor parallelism (Megatron's column and row layers, sequence parallelism).
"""

from __future__ import annotations

from commlab._lazy import lazy_getattr

__version__ = "0.3.0.dev0"

# Everything loads on first use, so that `import commlab` (and `commlab --help`) does not import
# torch, which costs seconds.
__getattr__ = lazy_getattr("commlab", {
    "LaunchError": "commlab.runtime.launch",
    "Runtime": "commlab.runtime.context",
    "init_from_env": "commlab.runtime.context",
    "launch": "commlab.runtime.launch",
    "DistributedDataParallel": "commlab.ddp",
    "ShardedDataParallel": "commlab.sharded",
    "Topology": "commlab.runtime.topology",
    "collectives": "commlab.collectives",
    "pipeline": "commlab.pipeline",
    "tensor": "commlab.tensor",
    "tune": "commlab.costmodel.search.api",
}, submodules=("collectives", "pipeline", "tensor"))


__all__ = [
    "DistributedDataParallel",
    "LaunchError",
    "Runtime",
    "ShardedDataParallel",
    "Topology",
    "collectives",
    "init_from_env",
    "launch",
    "pipeline",
    "tensor",
]
