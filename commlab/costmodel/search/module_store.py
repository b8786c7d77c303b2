"""A model given as an nn.Module instance, made nameable so that spawned ranks can build it.

Calibration spawns ranks (commlab.launch), and a rank builds its workload from a name
(commlab/models.py), never from the caller's objects. :func:`as_name` saves the module once,
whole (``torch.save``: the classes are pickled by reference, so they must be importable, as
for any ``package.module:factory``), under a digest of its class and parameter shapes, and
returns the factory name ``commlab.costmodel.search.module_store:load`` with ``digest=...`` as its size. The
digest makes the name stable across calls, so a cached calibration is found again;
timings do not depend on the weights' values, only on their shapes.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch
from torch import nn

FACTORY = "commlab.costmodel.search.module_store:load"


def store_dir() -> Path:
    """Where saved modules live (``COMMLAB_MODULE_DIR`` overrides; ranks inherit the environment)."""
    return Path(os.environ.get("COMMLAB_MODULE_DIR") or Path.home() / ".cache" / "commlab" / "modules")


def digest(module: nn.Module) -> str:
    """Class, ``repr`` (layer options and activations: a stride or a Tanh changes the step),
    parameter names/shapes/dtypes and input shape: what the step time depends on. A custom
    ``forward`` that differs with nothing else shows in none of these."""
    cls = type(module)
    desc = [f"{cls.__module__}.{cls.__qualname__}", repr(module), list(getattr(module, "input_shape", ()) or ()),
            [(n, list(p.shape), str(p.dtype), p.requires_grad) for n, p in module.named_parameters()]]
    # "m" prefix: the sweep's model-args parser would turn an all-digit digest into an int
    return "m" + hashlib.sha1(json.dumps(desc).encode()).hexdigest()[:16]


def as_name(module: nn.Module) -> tuple[str, str]:
    """(model name, model_args) under which ranks can build ``module``; saves it when new."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"expected an nn.Module, got {type(module).__name__}")
    if not any(p.requires_grad for p in module.parameters()):
        raise ValueError("the module has no trainable parameters: DDP has nothing to all-reduce")
    key = digest(module)
    path = store_dir() / f"{key}.pt"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        torch.save(module, tmp)
        os.replace(tmp, path)  # atomic: a concurrent reader sees the whole file or none
    return FACTORY, f"digest={key}"


def load(digest: str) -> nn.Module:
    """The factory the ranks call: the module saved by :func:`as_name`."""
    path = store_dir() / f"{digest}.pt"
    if not path.exists():
        raise ValueError(f"no saved module {digest!r} in {store_dir()} (pass the module to commlab.tune again)")
    return torch.load(path, weights_only=False)  # our own file, written by as_name
