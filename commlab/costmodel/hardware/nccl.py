"""An all-reduce priced as NCCL's own tuner prices it: ring and tree, latency and bandwidth each.

NCCL picks, for every call, the algorithm and protocol its model says is fastest
(``ncclTopoTuneModel`` and ``ncclTopoGetAlgoTime`` in NCCL's src/graph/tuning.cc, read at the
2.19-2.20 releases); this module follows that model for the Simple protocol, the one DDP's
megabyte buckets use (LL and LL128 win only below about 64 KiB-1 MiB):

    time = latency + bytes / algorithm bandwidth
    ring:  algbw = busbw x n / (2 (n - 1));
           latency = 8.4 us + (2 (n - 1) - inter) x max(3.4 us, 3 x net overhead) + inter x 14 us,
           inter = 2 x nodes across nodes (0 on one node); x 1.4 across nodes once each channel
           carries 64 bytes per rank ("plateau effect of ring"; 1.9 before compute capability 8.0);
    tree:  algbw = min(0.92 busbw, channels x per-channel tree cap) / 2 (the cap by GPU generation
           and 1, 2 or more nodes: perChMaxTreeBws), times NCCL's measured correction per
           power-of-two size below 512 MiB; latency = 2 ((n / nodes - 1) x 28 us + log2(nodes) x 28 us).

``busbw``: within one node the NVLink figure NCCL derives (the GPU's links x NCCL's per-link
speed); across nodes the network's, the NICs of a node times the per-channel speed NCCL's search
settles on for one NIC (each ring channel crosses the node boundary through its own NIC, so a
node's rings use all its NICs). Left out: NVLS/NVLink SHARP and CollNet (in-network reduction),
LL/LL128, fewer channels at small sizes, a NIC's extra latency (``latencyInter``, 0 on
InfiniBand). The figures a preset gives and their sources live in hardware.yaml.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from commlab.runs.traffic import bus_factor

# Simple protocol, microseconds (tuning.cc: baseLat, hwLat[NVLINK|NET][TREE|RING][SIMPLE]).
RING_BASE_US, RING_NVLINK_US, RING_NET_US = 8.4, 3.4, 14.0
TREE_BASE_US, TREE_NVLINK_US, TREE_NET_US = 0.0, 28.0, 28.0
# tuning.cc perChMaxTreeBws: GB/s per channel on 1 node, 2 nodes, more.
TREE_CAP_PER_CHANNEL = {"volta": (26.5, 18.5, 10.0), "ampere": (24.0, 23.6, 17.8), "hopper": (38.7, 41.4, 36.0)}
# tuning.cc treeCorrectionFactor[SIMPLE], by log2(bytes / 64) for 64 B .. 256 MiB
TREE_CORRECTION = (.9, .9, .9, .9, .9, .9, .9, .8, .7, .6, .6, .5, .5, .5, .5, .6, .7, .8, .7, .7, .8, .9, .9)


@dataclass(frozen=True)
class Network:
    """What NCCL's model needs to know about a machine's links (bandwidths in GB/s, 1e9 B/s)."""

    gpus_per_node: int
    nvlink_busbw: float  # within a node: links x NCCL's per-link speed
    nic_busbw: float  # per NIC (ring channel) across nodes
    nics_per_node: int
    channels: int = 16  # NCCL's channels (the tree's bandwidth cap is per channel)
    arch: str = "ampere"  # volta, ampere or hopper: the tree cap's row
    net_overhead_us: float = 1.0  # tuning.cc getNetOverhead: 1 us on Intel CPUs, 2 on AMD

    def __post_init__(self) -> None:
        if self.gpus_per_node < 1 or self.nics_per_node < 1 or self.channels < 1 or not (
                self.nvlink_busbw > 0 and self.nic_busbw > 0 and self.net_overhead_us >= 0):
            raise ValueError(f"a network needs positive sizes and bandwidths, got {self}")
        if self.arch not in TREE_CAP_PER_CHANNEL:
            raise ValueError(f"arch must be one of {', '.join(TREE_CAP_PER_CHANNEL)}, got {self.arch!r}")


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
        n, nodes, net = self.world_size, self.nodes(), self.network
        steps = 2 * (n - 1)
        inter = 2 * nodes if nodes > 1 else 0
        intra = max(RING_NVLINK_US, 3 * net.net_overhead_us) if nodes > 1 else RING_NVLINK_US
        latency = RING_BASE_US + (steps - inter) * intra + inter * RING_NET_US
        if nodes > 1 and nbytes / (net.channels * n) >= 64:
            latency *= 1.9 if net.arch == "volta" else 1.4
        algbw = self.busbw() * n / steps
        return latency * 1e-6 + nbytes / (algbw * 1e9)

    def tree_s(self, nbytes: float) -> float:
        n, nodes, net = self.world_size, self.nodes(), self.network
        cap = TREE_CAP_PER_CHANNEL[net.arch][min(nodes, 3) - 1] * net.channels
        algbw = min(0.92 * self.busbw(), cap) * 0.5
        size_class = int(math.log2(max(nbytes, 64) / 64))
        if size_class < len(TREE_CORRECTION):
            algbw *= TREE_CORRECTION[size_class]
        # integer arithmetic as in tuning.cc (nRanks / nNodes, log2i)
        latency = TREE_BASE_US + 2 * ((n // nodes - 1) * TREE_NVLINK_US + int(math.log2(nodes)) * TREE_NET_US)
        return latency * 1e-6 + nbytes / (algbw * 1e9)

    def algorithm(self, nbytes: float) -> str:
        """The algorithm NCCL's model picks for this size."""
        return "tree" if self.tree_s(nbytes) < self.ring_s(nbytes) else "ring"

    def __call__(self, nbytes: float) -> float:
        if self.world_size == 1:
            return 0.0
        return min(self.ring_s(nbytes), self.tree_s(nbytes))

    def bus_bandwidth(self, nbytes: float) -> float:
        """nccl-tests' busbw for this size, GB/s (commlab/runs/traffic.py)."""
        return nbytes / self(nbytes) * bus_factor("all_reduce", self.world_size) / 1e9
