"""Process groups in one place: launching ranks, the Runtime object, the tp x pp x dp topology.

Names load on first use (PEP 562), so that importing this package, as a spawned rank does
before it sets its parent-death signal, does not import torch.
"""

from __future__ import annotations

from commlab._lazy import lazy_getattr

_LAZY = {
    "LaunchError": "commlab.runtime.launch",
    "launch": "commlab.runtime.launch",
    "Runtime": "commlab.runtime.context",
    "init_from_env": "commlab.runtime.context",
    "resolve_backend": "commlab.runtime.context",
    "under_torchrun": "commlab.runtime.context",
}


__getattr__ = lazy_getattr("commlab.runtime", _LAZY)


__all__ = ["LaunchError", "Runtime", "init_from_env", "launch", "resolve_backend", "under_torchrun"]
