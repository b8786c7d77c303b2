"""Names a package loads on first use (PEP 562), so that importing it does not import torch."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Collection, Mapping
from typing import Any


def lazy_getattr(package: str, names: Mapping[str, str], submodules: Collection[str] = ()) -> Callable[[str], Any]:
    """A module-level ``__getattr__`` for ``package``: ``names[n]`` is the module that defines
    ``n``, imported the first time ``n`` is asked for; a name in ``submodules`` is that module."""

    def __getattr__(name: str) -> Any:
        if name not in names:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        module = importlib.import_module(names[name])
        return module if name in submodules else getattr(module, name)

    return __getattr__
