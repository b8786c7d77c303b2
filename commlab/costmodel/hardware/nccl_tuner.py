"""NCCL's tuner, one formula per concern: bandwidth, latency and time of (algorithm, protocol).

Follows ``ncclTopoTuneModel`` and ``ncclTopoGetAlgoTime`` in src/graph/tuning.cc of NCCL 2.20.3
(github.com/NVIDIA/nccl, commit b6475625; tables at lines 56-106, getNetOverhead 111-118, the
per-collective loop in ncclTopoTuneModel, the correction and the ring's plateau at the end of the
file). NCCL computes, once per communicator, a latency (us) and an algorithm bandwidth (GB/s) for
every collective, algorithm and protocol, and at every call picks the (algorithm, protocol) with the
least ``latency + bytes / bandwidth``; :func:`fastest` does the same. What the tuner reads of a
communicator (its graph's channels and per-channel speed, nodes, GPU generation, CPU vendor) is a
:class:`Comm`; deriving one from a machine and a group's placement is commlab/costmodel/hardware/nccl.py's job.

NVLS (the NVLink switch reducing in place, Hopper nodes) on one node and NVLS-tree across nodes
are priced where the communicator has an NVLS graph (``Comm.nvls_busbw``). Left out, and said
where a figure depends on it: CollNet/SHARP in the network (no preset has it), the tree
pattern's 0.85 (NCCL's searched trees on DGX-class nodes are balanced), a NIC's extra latency
(``latencyInter``, 0 on InfiniBand) and pipelined calls (``numPipeOps`` 1: one call at a time).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

PROTOCOLS = ("LL", "LL128", "Simple")
ALGORITHMS = ("tree", "ring", "nvls", "nvls_tree")
ARCHS = ("volta", "ampere", "hopper")  # tuning.cc's compCapIndex rows
CPUS = ("intel", "amd")

# Latencies in us (tuning.cc lines 56-59, 65-78); columns LL, LL128, Simple.
BASE_LAT = {"tree": (6.8, 14.0, 0.0), "ring": (6.6, 14.0, 8.4)}
NVLINK_LAT = {"tree": (0.6, 1.25, 28.0), "ring": (0.6, 1.9, 3.4)}
PCI_LAT = {"tree": (1.0, 1.9, 28.0), "ring": (1.0, 2.5, 5.7)}
NET_LAT = {"tree": (5.0, 8.5, 28.0), "ring": (2.7, 4.0, 14.0)}
NVLS_LAT_US, NVLS_TREE_NET_US = 23.0, 14.0  # hwLat[NVLINK][NVLS], hwLat[NET][NVLSTree], Simple
# Bandwidth caps, GB/s: [arch or CPU row][1 node, 2 nodes, more] (tuning.cc lines 86-106). The LL
# row is the GPU's on one node and the CPU vendor's across nodes (Intel row 0, AMD row 1).
LL_MAX = {"volta": (39.0, 39.0, 20.4), "ampere": (87.7, 22.5, 19.0), "hopper": (87.7, 22.5, 19.0)}
LL_MAX_NET = {"intel": LL_MAX["volta"], "amd": LL_MAX["ampere"]}
RING_LL128_PER_CH = {"volta": (20.0,) * 3, "ampere": (20.0,) * 3, "hopper": (36.7,) * 3}
TREE_LL128_PER_CH = {"volta": (20.0,) * 3, "ampere": (20.0,) * 3, "hopper": (36.7, 36.7, 29.0)}
TREE_PER_CH = {"volta": (26.5, 18.5, 10.0), "ampere": (24.0, 23.6, 17.8), "hopper": (38.7, 41.4, 36.0)}
NET_OVERHEAD_US = {"intel": 1.0, "amd": 2.0}  # getNetOverhead: posting a network send, per step
# treeCorrectionFactor, by log2(bytes / 64) for 64 B .. 256 MiB: NCCL's measured gap between its
# tree model and its trees at medium sizes; columns of PROTOCOLS.
TREE_CORRECTION = {
    "LL": (1.0, 1.0, 1.0, 1.0, .9, .8, .7, .7, .7, .7, .6, .5, .4, .4, .5, .6, .7, .8, .9, 1.0, 1.0, 1.0, 1.0),
    "LL128": (1.0, 1.0, 1.0, 1.0, 1.0, .9, .8, .8, .8, .7, .6, .6, .6, .6, .6, .6, .8, .9, .9, .9, .9, 1.0, 1.0),
    "Simple": (.9, .9, .9, .9, .9, .9, .9, .8, .7, .6, .6, .5, .5, .5, .5, .6, .7, .8, .7, .7, .8, .9, .9),
}


@dataclass(frozen=True)
class Comm:
    """What NCCL's tuner reads of one communicator."""

    ranks: int
    nodes: int
    busbw: float  # GB/s: the graph's channels x per-channel speed (bwIntra up to 2 nodes, bwInter beyond)
    channels: int  # the graph's channels (the per-channel caps scale with them)
    arch: str = "ampere"
    cpu: str = "intel"
    nvlink: bool = True  # GPUs of a node joined by NVLink (else PCI): latencies and LL128
    nvls_busbw: float = 0.0  # GB/s: the NVLS graph's channels x per-channel speed; 0: no NVLS

    def __post_init__(self) -> None:
        if not (self.ranks >= 1 and 1 <= self.nodes <= self.ranks and self.busbw > 0 and self.channels >= 1):
            raise ValueError(f"a communicator needs ranks >= nodes >= 1 and positive bandwidth and channels, got {self}")
        if self.arch not in ARCHS or self.cpu not in CPUS:
            raise ValueError(f"arch must be one of {ARCHS} and cpu one of {CPUS}, got {self.arch!r}, {self.cpu!r}")

    @property
    def column(self) -> int:
        """The caps' column: 1 node, 2 nodes, more (tuning.cc ``index2``)."""
        return min(self.nodes, 3) - 1


@dataclass(frozen=True)
class Collective:
    """One collective as the tuner sees it: its ring's steps and the algorithms NCCL offers it."""

    steps: Callable[[int], int]  # ranks -> the ring's steps (tuning.cc ``nsteps``)
    inter_steps: Callable[[int], int]  # nodes -> how many of them cross nodes (``nInterSteps``)
    algorithms: tuple[str, ...]
    ll_third: bool  # within a node the ring's LL moves a third of the bus bandwidth, not a quarter


# The registry, names as commlab/runs/traffic.py's COLLECTIVES; tree is offered to all-reduce only.
COLLECTIVES = {
    "all_reduce": Collective(lambda n: 2 * (n - 1), lambda k: 2 * k if k > 1 else 0, ALGORITHMS, False),
    "reduce_scatter": Collective(lambda n: n - 1, lambda k: k - 1, ("ring", "nvls"), True),
    "all_gather": Collective(lambda n: n - 1, lambda k: k - 1, ("ring", "nvls"), True),
    "broadcast": Collective(lambda n: n, lambda k: k, ("ring",), True),
    "reduce": Collective(lambda n: n, lambda k: k, ("ring",), False),
}


def collective(op: str) -> Collective:
    if op not in COLLECTIVES:
        raise ValueError(f"NCCL's model prices {', '.join(COLLECTIVES)}, not {op!r}")
    return COLLECTIVES[op]


def enabled(comm: Comm, op: str, algorithm: str, protocol: str) -> bool:
    """Which (algorithm, protocol) NCCL considers: LL128 by default only on NVLink nodes of one
    generation from Volta on; NVLS with Simple only, on one node (without CollNet), NVLS-tree across
    nodes (tuning.cc, the model loop and the enable rules after it)."""
    if algorithm.startswith("nvls"):
        return (protocol == "Simple" and comm.nvls_busbw > 0 and algorithm in collective(op).algorithms
                and (algorithm == "nvls") == (comm.nodes == 1))
    return algorithm in collective(op).algorithms and (protocol != "LL128" or comm.nvlink)


def bus_bandwidth(comm: Comm, op: str, algorithm: str, protocol: str) -> float:
    """The tuner's bus bandwidth, GB/s, before it becomes an algorithm bandwidth."""
    if algorithm.startswith("nvls"):
        return comm.nvls_busbw
    bw, col, arch = comm.busbw, comm.column, comm.arch
    ll_max = (LL_MAX[arch] if comm.nodes == 1 else LL_MAX_NET[comm.cpu])[col]
    if algorithm == "ring":
        if protocol == "LL":  # 8-byte lines carry 4 bytes of data and a flag
            return min(ll_max, bw * (1 / 3 if comm.nodes == 1 and collective(op).ll_third else 0.25))
        if protocol == "LL128":  # 128-byte lines carry 120 bytes; 0.7 when one GPU a node sends and receives through its NIC
            return min(bw * (0.7 if comm.ranks / comm.nodes < 2 else 0.92), comm.channels * RING_LL128_PER_CH[arch][col])
        return bw
    tree = min(bw * 0.92, comm.channels * TREE_PER_CH[arch][col])
    if protocol == "LL":
        return min(tree / 3.8, ll_max)
    if protocol == "LL128":
        return min(tree * (7 / 9 if comm.nodes == 1 else 120 / 128), comm.channels * TREE_LL128_PER_CH[arch][col])
    return tree


def algorithm_bandwidth(comm: Comm, op: str, algorithm: str, protocol: str, nbytes: float) -> float:
    """GB/s of the buffer: the ring's busbw x ranks / steps, the tree's half (each byte goes up and
    down), times the tree's measured correction at this size (ncclTopoGetAlgoTime); NVLS's 5/6."""
    bus = bus_bandwidth(comm, op, algorithm, protocol)
    if algorithm.startswith("nvls"):
        return bus * 5 / 6
    if algorithm == "ring":
        return bus * comm.ranks / collective(op).steps(comm.ranks)
    size_class = int(math.log2(max(int(nbytes) >> 6, 1)))
    table = TREE_CORRECTION[protocol]
    return bus * 0.5 * (table[size_class] if size_class < len(table) else 1.0)


def latency_us(comm: Comm, op: str, algorithm: str, protocol: str, nbytes: float) -> float:
    """The tuner's latency: a base plus a hop latency per step, NVLink (or PCI) inside a node and
    the network across; the ring's inter-node steps pay at least the network's posting overhead
    (x 3 for Simple), and a multi-node Simple all-reduce past 64 bytes per rank and channel x 1.4
    (1.9 before Ampere), NCCL's "plateau effect of ring"."""
    if algorithm == "nvls":
        return NVLS_LAT_US
    if algorithm == "nvls_tree":
        return NVLS_LAT_US + 2 * int(math.log2(comm.nodes)) * NVLS_TREE_NET_US
    p = PROTOCOLS.index(protocol)
    intra = (NVLINK_LAT if comm.nvlink else PCI_LAT)[algorithm][p]
    inter = NET_LAT[algorithm][p]
    lat = BASE_LAT[algorithm][p]
    if algorithm == "tree":
        return lat + 2 * ((comm.ranks // comm.nodes - 1) * intra + int(math.log2(comm.nodes)) * inter)
    n, n_inter = collective(op).steps(comm.ranks), collective(op).inter_steps(comm.nodes)
    hop = intra if comm.nodes == 1 else inter
    if op in ("broadcast", "reduce"):
        # Rings of a node on NVSwitch repeat the same order on every channel ("sameChannels": one
        # hop's latency); across nodes each channel takes its own NIC, so NCCL charges every step,
        # the Simple one at the tree's chunk latency. ASSUMED: same channels exactly on one node.
        if comm.nodes == 1:
            return lat + hop
        return lat + n * (NET_LAT["tree"][p] if protocol == "Simple" else hop)
    if comm.nodes > 1:
        intra = max(intra, NET_OVERHEAD_US[comm.cpu] * (3 if protocol == "Simple" else 1))
    lat += (n - n_inter) * intra + n_inter * inter
    # comm->nChannels is the graph's doubled by ncclTopoPostset (connect.cc)
    if protocol == "Simple" and op == "all_reduce" and comm.nodes > 1 and nbytes / (2 * comm.channels * comm.ranks) >= 64:
        lat *= 1.9 if comm.arch == "volta" else 1.4
    return lat


def time_us(comm: Comm, op: str, algorithm: str, protocol: str, nbytes: float) -> float:
    """Microseconds of one call: latency + bytes / algorithm bandwidth (1 GB/s = 1000 bytes/us)."""
    return latency_us(comm, op, algorithm, protocol, nbytes) + nbytes / (
        1000 * algorithm_bandwidth(comm, op, algorithm, protocol, nbytes))


def fastest(comm: Comm, op: str, nbytes: float) -> tuple[str, str, float]:
    """(algorithm, protocol, microseconds) NCCL's tuner picks for one call of ``nbytes``."""
    options = [(time_us(comm, op, a, p, nbytes), a, p) for a in ALGORITHMS for p in PROTOCOLS
               if enabled(comm, op, a, p)]
    t, a, p = min(options)
    return a, p, t
