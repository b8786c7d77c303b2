"""commlab: see and tune the communication of data- and pipeline-parallel training in PyTorch.

Public API (everything else is internal):

- ``commlab.launch`` / ``commlab.Runtime`` / ``commlab.init_from_env``: ranks and process groups;
- ``commlab.DistributedDataParallel``: torch's DDP, bucketed and overlapped in readable Python;
- ``commlab.ShardedDataParallel``: ZeRO stages 1-3 on flat padded buckets (torch's ``fully_shard``'s results);
- ``commlab.collectives``: ring, tree and halving-doubling all-reduce on point-to-point ops;
- ``commlab.pipeline``: GPipe, 1F1B and interleaved pipeline schedules.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.3.0.dev0"

# Everything loads on first use, so that `import commlab` (and `commlab --help`) does not import
# torch, which costs seconds.
_LAZY = {
    "LaunchError": ("commlab.runtime.launch", "LaunchError"),
    "Runtime": ("commlab.runtime.context", "Runtime"),
    "init_from_env": ("commlab.runtime.context", "init_from_env"),
    "launch": ("commlab.runtime.launch", "launch"),
    "DistributedDataParallel": ("commlab.ddp", "DistributedDataParallel"),
    "ShardedDataParallel": ("commlab.sharded", "ShardedDataParallel"),
    "Topology": ("commlab.runtime.topology", "Topology"),
    "collectives": ("commlab.collectives", None),
    "pipeline": ("commlab.pipeline", None),
    "tune": ("commlab.costmodel.api", "tune"),
}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'commlab' has no attribute {name!r}")
    module_name, attr = _LAZY[name]
    module = importlib.import_module(module_name)
    return module if attr is None else getattr(module, attr)


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
]
