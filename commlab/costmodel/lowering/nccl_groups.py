"""Collectives over a placed group of GPUs: NCCL's tuner where the hardware package has it.

The lowerings price every collective as ``collective_seconds(network, op, nbytes, group)``, with
``group = Group(size, per_node, sharing)``: ``size`` ranks, ``per_node`` of them on each node,
``sharing`` such groups at once on a node sharing its NICs; ``nbytes`` is the all-reduce's input,
the all-gather's output, the reduce-scatter's input. That function lives in
commlab/costmodel/hardware/nccl.py once it prices every collective; until then this module's
stand-in prices them from the all-reduce model there (ring and tree, Simple protocol): the group
sees its per-node GPUs and its share of the node's NICs, and a reduce-scatter or all-gather moves
half an all-reduce's bytes with half its latency (each is one of the all-reduce's two phases).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from commlab.costmodel.hardware import nccl

try:  # the hardware package's own, where it has it
    from commlab.costmodel.hardware.nccl import Group, collective_seconds  # type: ignore[attr-defined]
except ImportError:
    OPS = ("all_reduce", "reduce_scatter", "all_gather", "broadcast")

    @dataclass(frozen=True)
    class Group:  # type: ignore[no-redef]
        """One communicator's placement (the module docstring)."""

        size: int
        per_node: int
        sharing: int = 1

        def __post_init__(self) -> None:
            if min(self.size, self.per_node, self.sharing) < 1 or self.per_node > self.size:
                raise ValueError(f"a group needs 1 <= per_node <= size and sharing >= 1, got {self}")

    def collective_seconds(network: nccl.Network, op: str, nbytes: float, group: Group) -> float:  # type: ignore[misc]
        if op not in OPS:
            raise ValueError(f"unknown collective {op!r}: one of {', '.join(OPS)}")
        if group.size == 1:
            return 0.0
        nodes = math.ceil(group.size / group.per_node)
        if nodes > 1 and group.per_node * group.sharing > network.gpus_per_node:
            raise ValueError(f"{group.sharing} group(s) of {group.per_node} do not fit a {network.gpus_per_node}-GPU node")
        nics = network.nics_per_node / group.sharing  # this group's share of the node's NICs
        whole = max(1, math.floor(nics))
        net = replace(network, gpus_per_node=group.per_node, nics_per_node=whole,
                      nic_busbw=network.nic_busbw * nics / whole)
        allreduce = nccl.NCCLAllReduce(net, group.size)
        if op == "all_reduce":
            return allreduce(nbytes)
        if op == "broadcast":  # a pipelined ring: every byte crosses each link once
            return allreduce.ring_s(0.0) / 2 + nbytes / (allreduce.busbw() * 1e9)
        return allreduce.ring_s(nbytes) / 2  # one of the two phases of the ring all-reduce of this buffer

__all__ = ["Group", "collective_seconds"]
