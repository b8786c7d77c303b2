"""Module-level ``__getattr__`` (PEP 562): names loaded on first use, and renamed names that warn.

Lazy names keep torch out of ``import commlab``; a renamed public name keeps working for a
release, with a FutureWarning naming the new one, so that a user's code says what to change.
"""

from __future__ import annotations

import importlib
import sys
import warnings
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


def renamed_getattr(module: str, renamed: Mapping[str, str],
                    then: Callable[[str], Any] | None = None) -> Callable[[str], Any]:
    """A module-level ``__getattr__`` for ``module`` answering each old name of ``renamed`` (old ->
    new) with the new name's object and a FutureWarning; other names go to ``then`` (say, a
    :func:`lazy_getattr`), if given."""

    def __getattr__(name: str) -> Any:
        if name in renamed:
            new = renamed[name]
            warnings.warn(f"{module}.{name} is deprecated and will be removed in a later release: use "
                          f"{module}.{new}", FutureWarning, stacklevel=2)
            return getattr(sys.modules[module], new)
        if then is not None:
            return then(name)
        raise AttributeError(f"module {module!r} has no attribute {name!r}")

    return __getattr__
