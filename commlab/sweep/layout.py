"""A sweep configuration's parallel layout on its ranks: tensor x data groups, and each axis's seconds per step.

Ranks are laid out by :class:`commlab.Topology` in torch's ``init_device_mesh`` order: data
parallelism outermost, tensor parallelism innermost, so that a tensor-parallel group is
consecutive ranks (on one node, on the fastest links, when there are several). With one pipeline
stage rank r has tensor-parallel index r % tp and data-parallel index r // tp.
"""

from __future__ import annotations

from typing import Any

from commlab.runs.store import AXIS_COLUMNS

# commlab.tensor's collective kinds -> the iteration column of their seconds.
_TP_COLUMNS = {"all_reduce": "tp_all_reduce", "all_gather": "tp_all_gather", "reduce_scatter": "tp_reduce_scatter"}


def rank_groups(world_size: int, tp: int) -> tuple[list[list[int]], list[list[int]]]:
    """The tensor-parallel groups and the data-parallel groups of ``world_size`` ranks (pure; one
    pipeline stage), as :meth:`commlab.Topology.build` creates them from the mesh."""
    from commlab.runtime.topology import check_dims, mesh

    tp, _, dp = check_dims(world_size, tp=tp)
    replicas = [stages[0] for stages in mesh(tp, 1, dp)]
    return replicas, [list(column) for column in zip(*replicas)]


def build_groups(cfg) -> tuple[Any, Any, int, Any]:
    """(tensor-parallel group, data-parallel group, data-parallel index, replicate group) of this
    rank, from the tp x pp x dp :class:`commlab.Topology`. With hybrid sharding (a shard group
    smaller than dp) the data-parallel group is this rank's shard group and the replicate group
    links the ranks holding the same shard; otherwise the replicate group is None. The world
    (None) and the rank alone when there is one axis, so that data-parallel configurations create
    no groups. Collective: every rank calls it."""
    import torch.distributed as dist

    from commlab.runtime.topology import Topology

    if cfg.tp == 1 and cfg.pp == 1 and not cfg.shard_group:
        return None, None, dist.get_rank(), None
    if cfg.shard_group:
        topology = Topology.build(tp=cfg.tp, pp=cfg.pp, dp=cfg.dp, shard=cfg.shard_group)
        return topology.tp_group, topology.shard_group, topology.replica, topology.replicate_group
    topology = Topology.build(tp=cfg.tp, pp=cfg.pp, dp=cfg.dp)
    return topology.tp_group, topology.dp_group, topology.replica, None


def axis_seconds(tensor_iterations: list, accumulate: int, steps: int) -> list[dict[str, float]]:
    """Per step (the last ``steps``), the seconds in each kind of tensor-parallel collective.

    ``tensor_iterations`` are commlab.tensor's timings, one per forward of the model; a step is
    ``accumulate`` forwards. Pipeline send/recv is zero (one stage); the data-parallel reduction
    is the wrapper's own column, filled in by the caller.
    """
    wanted = steps * accumulate
    if len(tensor_iterations) < wanted:
        raise RuntimeError(f"commlab.tensor recorded {len(tensor_iterations)} forwards for {steps} step(s) "
                           f"of {accumulate} micro-batch(es)")
    recent = tensor_iterations[len(tensor_iterations) - wanted:]
    out = []
    for s in range(steps):
        row = dict.fromkeys(AXIS_COLUMNS, 0.0)
        for it in recent[s * accumulate:(s + 1) * accumulate]:
            for c in it.collectives:
                row[_TP_COLUMNS[c.kind]] += c.end - c.start
        out.append(row)
    return out
