"""An all-reduce priced as NCCL's own tuner prices it: ring and tree, latency and bandwidth each.

NCCL picks, for every call, the algorithm and protocol its model says is fastest
(``ncclTopoTuneModel`` and ``ncclTopoGetAlgoTime`` in NCCL's src/graph/tuning.cc, read at the
2.9-2.12 releases); this module follows that model for the Simple protocol, the one DDP's
megabyte buckets use (LL and LL128 win only below about 64 KiB-1 MiB):

    time = latency + bytes / algorithm bandwidth
    ring:  algbw = busbw x n / (2 (n - 1));  latency = 8.4 us + (intra steps) x 3.4 us + (inter steps) x 9.6 us
           with 2 (n - 1) steps, 2 (nodes - 1) of them across the network; x 1.9 across nodes above
           n / 16 x 64 KiB ("plateau effect of ring");
    tree:  algbw = min(0.9 busbw, 80 GB/s beyond 2 nodes, else 110) / 2;
           latency = 2 ((n / nodes - 1) x 28 us + log2(nodes) x 50 us);
           bandwidth scaled by NCCL's measured correction per power-of-two size below 256 MiB.

``busbw``: within one node the NVLink figure NCCL derives (links x NCCL's per-link speed,
capped at 235 GB/s on compute capability 8.0 as tuning.cc caps it); across nodes the network's,
the NICs of a node times the per-channel speed NCCL's search settles on for one NIC (each ring
channel crosses the node boundary through its own NIC, so a node's rings use all its NICs).
Left out: NVLS/NVLink SHARP and CollNet (in-network reduction), LL/LL128, the number of channels
at small sizes. The figures a preset gives and their sources live in hardware.yaml.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# Simple protocol, microseconds (tuning.cc: baseLat, hwLat[NVLINK|NET][TREE|RING][SIMPLE]).
RING_BASE_US, RING_NVLINK_US, RING_NET_US = 8.4, 3.4, 9.6
TREE_BASE_US, TREE_NVLINK_US, TREE_NET_US = 0.0, 28.0, 50.0
PLATEAU = 1.9
# tuning.cc treeCorrectionFactor[SIMPLE], by log2(bytes / 64) for 64 B .. 128 MiB
TREE_CORRECTION = (.9, .9, .9, .9, .9, .9, .9, .8, .7, .6, .6, .5, .5, .5, .5, .5, .5, .6, .6, .7, .8, .9)


@dataclass(frozen=True)
class Network:
    """What NCCL's model needs to know about a machine's links (bandwidths in GB/s, 1e9 B/s)."""

    gpus_per_node: int
    nvlink_busbw: float  # within a node: min(links x per-link speed, NCCL's cap)
    nic_busbw: float  # per NIC (ring channel) across nodes
    nics_per_node: int

    def __post_init__(self) -> None:
        if self.gpus_per_node < 1 or self.nics_per_node < 1 or not (self.nvlink_busbw > 0 and self.nic_busbw > 0):
            raise ValueError(f"a network needs positive sizes and bandwidths, got {self}")


@dataclass(frozen=True)
class NCCLAllReduce:
    """bytes -> seconds of one all-reduce over ``world_size`` GPUs, NCCL's faster algorithm."""

    network: Network
    world_size: int

    def nodes(self) -> int:
        return math.ceil(self.world_size / self.network.gpus_per_node)

    def busbw(self) -> float:
        net = self.network
        if self.nodes() == 1:
            return net.nvlink_busbw
        return min(net.nic_busbw * net.nics_per_node, net.nvlink_busbw)

    def ring_s(self, nbytes: float) -> float:
        n, nodes = self.world_size, self.nodes()
        steps, inter = 2 * (n - 1), 2 * (nodes - 1)
        latency = RING_BASE_US + (steps - inter) * RING_NVLINK_US + inter * RING_NET_US
        if nodes > 1 and nbytes >= n / 16 * 65536:
            latency *= PLATEAU
        algbw = self.busbw() * n / steps
        return latency * 1e-6 + nbytes / (algbw * 1e9)

    def tree_s(self, nbytes: float) -> float:
        n, nodes = self.world_size, self.nodes()
        busbw = min(0.9 * self.busbw(), 80.0 if nodes > 2 else 110.0)
        algbw = busbw * 0.5
        size_class = int(math.log2(max(nbytes, 64) / 64))
        if size_class < len(TREE_CORRECTION):
            algbw *= TREE_CORRECTION[size_class]
        latency = TREE_BASE_US + 2 * ((n / nodes - 1) * TREE_NVLINK_US + math.log2(nodes) * TREE_NET_US)
        return latency * 1e-6 + nbytes / (algbw * 1e9)

    def algorithm(self, nbytes: float) -> str:
        """The algorithm NCCL's model picks for this size."""
        return "tree" if self.tree_s(nbytes) < self.ring_s(nbytes) else "ring"

    def __call__(self, nbytes: float) -> float:
        if self.world_size == 1:
            return 0.0
        return min(self.ring_s(nbytes), self.tree_s(nbytes))

    def bus_bandwidth(self, nbytes: float) -> float:
        """nccl-tests' busbw for this size, GB/s: algbw x 2 (n - 1) / n (nccl-tests doc/PERFORMANCE.md)."""
        n = self.world_size
        return nbytes / self(nbytes) * 2 * (n - 1) / n / 1e9
