"""Bytes on the wire: what each collective moves through a rank, and sizes written as "64M".

Over n ranks the bandwidth-optimal collectives (ring or halving-doubling; Thakur, Rabenseifner
and Gropp, "Optimization of Collective Communication Operations in MPICH", 2005) move, through
every rank, 2(n-1)/n S bytes for an all-reduce of S bytes (a reduce-scatter then an all-gather),
(n-1)/n S for a reduce-scatter or an all-gather, and S for a broadcast or a reduce (through the
root's link). The same factor turns nccl-tests' algorithm bandwidth S/t into its bus bandwidth
(nccl-tests, doc/PERFORMANCE.md), and counts the bytes a step sent (the sweep's ``comm_bytes``).
This is the one table of it; the benchmarks, the sweep and the cost model all read it here.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

# Multiples of (n-1)/n S (all-reduce, reduce-scatter, all-gather) or of S (broadcast, reduce).
_SHARE_FACTORS = {"all_reduce": 2, "reduce_scatter": 1, "all_gather": 1}
_WHOLE = ("broadcast", "reduce")
COLLECTIVES = (*_SHARE_FACTORS, *_WHOLE)


def bus_factor(kind: str, world_size: int) -> float:
    """Bytes through one rank per byte of the collective's buffer (this module's docstring)."""
    if kind in _WHOLE:
        return 1.0
    if kind not in _SHARE_FACTORS:
        raise ValueError(f"unknown collective {kind!r}: one of {', '.join(COLLECTIVES)}")
    return _SHARE_FACTORS[kind] * (world_size - 1) / world_size


def comm_bytes(collectives: Iterable[tuple[str, int]], world_size: int) -> float:
    """Bytes one rank sends for these (kind, buffer bytes) collectives."""
    return sum(bus_factor(kind, world_size) * nbytes for kind, nbytes in collectives)


# Hybrid sharding's all-reduce of a reduced bucket across the replicas: its kind in timings, tables
# and records (it runs over the replicate group, not the shard group of the other collectives).
REPLICATE_ALL_REDUCE = "replicate_all_reduce"


def hybrid_comm_bytes(collectives: Iterable[tuple[str, int]], shard: int, replicas: int) -> float:
    """Bytes one rank sends for a sharded step's (kind, buffer bytes) collectives: those of the
    shard group at its size, the all-reduces across replicas (:data:`REPLICATE_ALL_REDUCE`) at theirs."""
    collectives = list(collectives)
    own = comm_bytes(((k, n) for k, n in collectives if k != REPLICATE_ALL_REDUCE), shard)
    return own + comm_bytes((("all_reduce", n) for k, n in collectives if k == REPLICATE_ALL_REDUCE), replicas)


_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
_SIZE = re.compile(r"^\s*(\d+)\s*([KMG]?)(I?B)?\s*$", re.IGNORECASE)


def parse_size(text: str | int) -> int:
    """Bytes from "4096", "1K", "64M", "1G" (binary units, as nccl-tests); also "64MB", "64MiB"."""
    if isinstance(text, int):
        value = text
    else:
        m = _SIZE.match(str(text))
        if not m:
            raise ValueError(f"cannot read size {text!r}: use a whole number with an optional K, M or G (e.g. 64M)")
        value = int(m.group(1)) * _UNITS[m.group(2).upper()]
    if value < 1:
        raise ValueError(f"size must be at least 1 byte, got {text!r}")
    return value


def format_size(nbytes: int) -> str:
    """"64M" for 64 MiB: the largest binary unit that divides ``nbytes``."""
    for unit in ("G", "M", "K"):
        if nbytes % _UNITS[unit] == 0:
            return f"{nbytes // _UNITS[unit]}{unit}"
    return str(nbytes)
