"""Hybrid sharding (HSDP): the shard group's reduction of a bucket, then its all-reduce across replicas.

With a replicate group, each parameter is sharded within its shard group and replicated across
the replicate group (torch's ``fully_shard`` on a 2-D mesh, ``(Replicate(), Shard(0))``:
torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py reduce-scatters in the shard group and
then all-reduces the result across replicas). All-gathers stay in the shard group; a bucket's
gradient is reduced in the shard group (stage 1 all-reduces the whole buffer, stages 2-3
reduce-scatter it) and the result, the whole buffer or the rank's shard, is then all-reduced
across the replicas (a :class:`Replication`), so every replica steps identical shards.

Why stage 1 all-reduces twice rather than once over every data-parallel rank: the wrapper is given
the two groups only (a group over all of them would be one more ``new_group``, collective over the
world, which belongs to the topology), and one path serves every stage. It moves more bytes per
rank: 2(s-1)/s + 2(r-1)/r buffers against one ring's 2(sr-1)/(sr) (2 against 1.5 at 2 x 2); a
reduce-scatter, all-reduce of the shard and all-gather would match the ring's bytes at the cost of
a third collective per bucket (not done).
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from commlab.runs.traffic import REPLICATE_ALL_REDUCE
from commlab.sharded import comm


def check_groups(shard_group: dist.ProcessGroup | None, replicate_group: dist.ProcessGroup | None) -> int:
    """How many replicas (1 without a replicate group); ValueError, before any collective, unless
    this rank is the only one the two groups share (a replica's ranks must hold different shards)."""
    if replicate_group is None:
        return 1
    if not isinstance(replicate_group, dist.ProcessGroup):
        raise ValueError(f"replicate_group must be a ProcessGroup or None, got {type(replicate_group).__name__}")
    shard = set(range(dist.get_world_size()) if shard_group is None else dist.get_process_group_ranks(shard_group))
    common = shard & set(dist.get_process_group_ranks(replicate_group))
    if common != {dist.get_rank()}:
        raise ValueError(
            f"the shard group and the replicate group share ranks {sorted(common)}: they must meet in this rank "
            f"({dist.get_rank()}) only, as a row and a column of a (replicate, shard) grid do "
            "(commlab.Topology.build(..., shard=k) gives them as shard_group and replicate_group)"
        )
    return dist.get_world_size(replicate_group)


def hybrid_mesh(shard_group: dist.ProcessGroup, replicate_group: dist.ProcessGroup, device_type: str) -> DeviceMesh:
    """The 2-D (replicate, shard) DeviceMesh over the two groups (as fully_shard's HSDP mesh), so
    that DTensor reductions (clip_grad_norm_'s) run over the shard dimension only and checkpoints
    know the shards are replicated. A collective over the replicate group: each replica's shard
    group's ranks make a row of the grid."""
    rows: list = [None] * dist.get_world_size(replicate_group)
    dist.all_gather_object(rows, dist.get_process_group_ranks(shard_group), group=replicate_group)
    return DeviceMesh.from_group([replicate_group, shard_group], device_type, mesh=torch.tensor(rows),
                                 mesh_dim_names=("replicate", "shard"))


class Replication:
    """The all-reduce of ``tensor`` across replicas after the shard group's reduction ``first``.

    It must be issued asynchronously after ``first`` completes, without blocking backward. A p2p
    algorithm's ``first`` runs on the shard group's worker thread (commlab/collectives/worker.py):
    its future's callback, run there the moment ``first`` completes, queues the all-reduce on the
    replicate group's own worker, so it overlaps backward and the shard group's next reduction, and
    each group's collectives keep one order on every rank. The backend's collectives (``native``)
    give no such callback for every collective (Gloo's reduce-scatter has no future), so there the
    all-reduce is launched when ``first`` is waited for (:meth:`start`): at stages 2-3 the engine
    does that before the next bucket's reduce-scatter and waits for the all-reduce before the one
    after, so it overlaps a bucket's backward; stage 1 waits only at the end of backward, where its
    native all-reduces across replicas are then exposed. On NCCL a wait only orders streams, so
    launching there costs the host nothing; on Gloo, "auto" picks the ring, which chains.
    """

    def __init__(self, first, tensor: torch.Tensor, group: dist.ProcessGroup, algorithm: str):
        self.tensor, self.group, self.algorithm = tensor, group, algorithm
        self.work = None
        self.ready = self.launched = float("nan")
        self.nbytes = tensor.numel() * tensor.element_size()
        # value() re-raises a failed first level: the chain then fails and launches nothing.
        self.chain = None if algorithm == "native" else first.get_future().then(lambda f: self._launch(f.value()))

    def _launch(self, _=None) -> None:
        self.ready = self.launched = time.perf_counter()  # its input, the first level's result, is there
        self.work = comm.all_reduce(self.tensor, self.group, self.algorithm)

    def start(self) -> Replication:
        """After ``first``'s wait: launch the all-reduce unless the callback has."""
        if self.chain is None:
            self._launch()
        return self

    def entry(self, recorder, bucket: int):
        """Its timing entry, kind "replicate_all_reduce" (commlab/sharded/timing.py)."""
        if self.chain is not None:
            self.chain.wait()  # launched: its stamps are set
        entry = recorder.launched(bucket, REPLICATE_ALL_REDUCE, self.nbytes, self.ready)
        entry.launched = self.launched
        return entry

    def wait(self) -> None:
        if self.chain is not None:
            self.chain.wait()
        self.work.wait()
