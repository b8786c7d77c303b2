"""A collective over a group of GPUs priced as NCCL's tuner prices it, wherever the group sits.

    collective_seconds(network, "all_reduce", 64 << 20, Group(size=256, per_node=8))
    bus_bandwidth(network, "all_gather", 64 << 20, Group(size=32, per_node=1, sharing=8))

A :class:`Network` is the machine (what a preset states); a :class:`Group` is where one
communicator's ranks sit: how many, how many on each node, and how many such groups run at once
on a node, sharing its NICs (data-parallel groups across nodes while tensor-parallel groups sit
inside one: 8 DP groups of one GPU a node share a DGX's 8 NICs, one each; a TP group of 8 on one
node uses NVLink alone). From both this module derives what NCCL's tuner reads of the communicator
(commlab/costmodel/hardware/nccl_tuner.py), then takes the (algorithm, protocol) the tuner picks.

How a placement becomes the tuner's bandwidth (NCCL's graph search, src/graph/search.cc):
- on one node, the NVLink figure (the GPU's links x NCCL's per-link speed), whatever the group's
  size: NVSwitch gives each GPU its own links, so concurrent groups on a node do not share them;
- across nodes, each ring channel leaves a node through one NIC at the per-NIC ring speed NCCL's
  search settles on; a group uses the NICs next to its GPUs (``per_node`` x NICs per GPU) and no
  more than its share of the node's (``nics_per_node / sharing``): fractional shares are time-shared.
  Its channels scale with those NICs (the per-channel caps of the tuner follow them), at least one;
- NVLS (where the switches reduce): one channel per GPU of the node, each GPU the head of one;
  a head's link carries twice a channel's speed and every other GPU's once, so the search settles
  on the fastest speed of its table (search.cc sm90SpeedArrayIntra) within NVLink / (GPUs + 1);
  across nodes (NVLS-tree) each head also takes a NIC, at most its speed (half beyond 2 nodes).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from commlab.costmodel.hardware import nccl_tuner as tuner
from commlab.runs.traffic import bus_factor

COLLECTIVES = tuple(tuner.COLLECTIVES)
# src/graph/search.cc (NCCL 2.19-2.20) sm90SpeedArrayIntra: the per-channel speeds an NVLS search tries.
NVLS_SPEEDS = (60.0, 50.0, 40.0, 30.0, 24.0, 20.0, 15.0, 12.0, 11.0, 6.0, 3.0)


@dataclass(frozen=True)
class Network:
    """What NCCL's model needs to know about a machine's links (bandwidths in GB/s, 1e9 B/s)."""

    gpus_per_node: int
    nvlink_busbw: float  # within a node: links x NCCL's per-link speed
    nic_busbw: float  # per NIC (ring channel) across nodes
    nics_per_node: int
    channels: int = 16  # NCCL's channels on a full node (the tuner's per-channel caps scale with them)
    arch: str = "ampere"  # volta, ampere or hopper: the caps' row
    cpu: str = "intel"  # intel or amd: the network's posting overhead and the multi-node LL cap
    nvls: bool = False  # NVSwitches that reduce in place (NVLink SHARP: third-generation NVSwitch, Hopper)

    def __post_init__(self) -> None:
        if self.gpus_per_node < 1 or self.nics_per_node < 1 or self.channels < 1 or not (
                self.nvlink_busbw > 0 and self.nic_busbw > 0):
            raise ValueError(f"a network needs positive sizes and bandwidths, got {self}")
        if self.arch not in tuner.ARCHS:
            raise ValueError(f"arch must be one of {', '.join(tuner.ARCHS)}, got {self.arch!r}")
        if self.cpu not in tuner.CPUS:
            raise ValueError(f"cpu must be one of {', '.join(tuner.CPUS)}, got {self.cpu!r}")


@dataclass(frozen=True)
class Group:
    """One communicator's placement: ``size`` ranks, ``per_node`` of them on each node (the last
    node may hold fewer), and ``sharing`` such groups running at once on each node (sharing its NICs)."""

    size: int
    per_node: int
    sharing: int = 1

    def __post_init__(self) -> None:
        if not all(isinstance(v, int) and v >= 1 for v in (self.size, self.per_node, self.sharing)):
            raise ValueError(f"a group's size, per_node and sharing are positive integers, got {self}")
        if self.per_node > self.size:
            raise ValueError(f"a group of {self.size} cannot have {self.per_node} ranks on a node")

    @property
    def nodes(self) -> int:
        return math.ceil(self.size / self.per_node)


def communicator(network: Network, group: Group) -> tuner.Comm:
    """What NCCL's tuner reads of ``group``'s communicator on ``network`` (the module docstring)."""
    if group.per_node * group.sharing > network.gpus_per_node:
        raise ValueError(f"{group.sharing} group(s) of {group.per_node} GPUs a node do not fit on "
                         f"{network.gpus_per_node}-GPU nodes")
    if group.nodes == 1:
        busbw, channels = network.nvlink_busbw, network.channels
    else:
        nics = min(network.nics_per_node / group.sharing,
                   group.per_node * network.nics_per_node / network.gpus_per_node)
        busbw = min(network.nvlink_busbw, network.nic_busbw * nics)
        channels = max(1, round(network.channels * nics / network.nics_per_node))
    return tuner.Comm(group.size, group.nodes, busbw, channels, network.arch, network.cpu,
                      nvls_busbw=nvls_busbw(network, group))


def nvls_busbw(network: Network, group: Group) -> float:
    """The NVLS graph's channels x per-channel speed for this group, 0 without NVLS (module docstring)."""
    k = group.per_node
    if not network.nvls or k < 2:
        return 0.0
    speed = next((s for s in NVLS_SPEEDS if s * (k + 1) <= network.nvlink_busbw), 0.0)
    if group.nodes > 1:
        nics = min(network.nics_per_node / group.sharing, k * network.nics_per_node / network.gpus_per_node)
        per_head = network.nic_busbw * min(1.0, nics / k)
        speed = min(speed, per_head if group.nodes <= 2 else per_head / 2)
    return k * speed


def choice(network: Network, op: str, nbytes: float, group: Group) -> tuple[str, str]:
    """(algorithm, protocol) NCCL's tuner picks for this call."""
    algorithm, protocol, _ = tuner.fastest(communicator(network, group), op, nbytes)
    return algorithm, protocol


def collective_seconds(network: Network, op: str, nbytes: float, group: Group) -> float:
    """Seconds of one ``op`` of ``nbytes`` (the buffer: the all-reduce's input, the all-gather's
    output, the reduce-scatter's input) over ``group``, NCCL's fastest (algorithm, protocol)."""
    tuner.collective(op)
    if group.size == 1:
        return 0.0
    return tuner.fastest(communicator(network, group), op, nbytes)[2] * 1e-6


def bus_bandwidth(network: Network, op: str, nbytes: float, group: Group) -> float:
    """nccl-tests' busbw for this call, GB/s (the factor: commlab/runs/traffic.py)."""
    if group.size == 1:
        raise ValueError("a group of one moves nothing: its bus bandwidth is undefined")
    return nbytes / collective_seconds(network, op, nbytes, group) * bus_factor(op, group.size) / 1e9


def full_nodes(network: Network, world_size: int) -> Group:
    """``world_size`` ranks packed onto whole nodes, one communicator (a DDP world)."""
    return Group(world_size, min(world_size, network.gpus_per_node))


def hybrid_groups(network: Network, world_size: int, shard: int) -> tuple[Group, Group]:
    """Hybrid sharding's two communicators on ``world_size`` ranks packed on whole nodes: a shard
    group of ``shard`` consecutive ranks (on one node when it fits), and a replica group of every
    ``shard``-th rank (``gpus_per_node / shard`` of them on a node, the node's other replica groups
    sharing its NICs), as torch's init_device_mesh((replicate, shard)) lays them out."""
    if shard < 1 or world_size % shard:
        raise ValueError(f"a shard group of {shard} does not divide a world of {world_size}")
    gpn, replicas = network.gpus_per_node, world_size // shard
    per_node = max(1, min(replicas, gpn // shard))
    across = Group(replicas, per_node, sharing=max(1, gpn // per_node) if replicas > per_node else 1)
    # a shard group larger than a node spans whole nodes alone; smaller ones share a node's NVSwitch,
    # which gives each GPU its own links (no sharing to model)
    return Group(shard, min(shard, gpn)), across


@dataclass(frozen=True)
class NCCLAllReduce:
    """bytes -> seconds of one all-reduce over ``world_size`` GPUs packed on whole nodes."""

    network: Network
    world_size: int

    def __call__(self, nbytes: float) -> float:
        return collective_seconds(self.network, "all_reduce", nbytes, full_nodes(self.network, self.world_size))

    def algorithm(self, nbytes: float) -> str:
        """The algorithm NCCL's model picks for this size."""
        return choice(self.network, "all_reduce", nbytes, full_nodes(self.network, self.world_size))[0]

    def bus_bandwidth(self, nbytes: float) -> float:
        return bus_bandwidth(self.network, "all_reduce", nbytes, full_nodes(self.network, self.world_size))
