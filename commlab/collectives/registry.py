"""The one registry of all-reduce algorithms, so DDP, the benchmark and the CLI list the same names."""

from __future__ import annotations

from collections.abc import Callable

# name -> implementation with the signature of commlab.collectives.all_reduce minus `algorithm`.
_ALGORITHMS: dict[str, Callable] = {}


def register(name: str) -> Callable[[Callable], Callable]:
    def wrap(fn: Callable) -> Callable:
        if name in _ALGORITHMS:
            raise ValueError(f"all-reduce algorithm {name!r} is registered twice")
        _ALGORITHMS[name] = fn
        return fn

    return wrap


def algorithm_names() -> list[str]:
    return list(_ALGORITHMS)


def get_algorithm(name: str) -> Callable:
    try:
        return _ALGORITHMS[name]
    except KeyError:
        raise ValueError(
            f"unknown all-reduce algorithm {name!r}: choose from {', '.join(_ALGORITHMS)}"
        ) from None
