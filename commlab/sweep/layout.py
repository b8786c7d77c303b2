"""A sweep configuration's parallel layout on its ranks: tensor x data groups, and each axis's seconds per step.

Ranks are laid out as torch's ``init_device_mesh`` orders a (dp, tp) mesh: data parallelism
outermost, tensor parallelism innermost, so that a tensor-parallel group is consecutive ranks
(on one node, on the fastest links, when there are several). Rank r has tensor-parallel index
r % tp and data-parallel index r // tp.
"""

from __future__ import annotations

from typing import Any

from commlab.runs.store import AXIS_COLUMNS

# commlab.tensor's collective kinds -> the iteration column of their seconds.
_TP_COLUMNS = {"all_reduce": "tp_all_reduce", "all_gather": "tp_all_gather", "reduce_scatter": "tp_reduce_scatter"}


def rank_groups(world_size: int, tp: int) -> tuple[list[list[int]], list[list[int]]]:
    """The tensor-parallel groups and the data-parallel groups of ``world_size`` ranks (pure)."""
    if tp < 1 or world_size % tp:
        raise ValueError(f"tensor-parallel size {tp} does not divide world size {world_size}")
    dp = world_size // tp
    return ([[d * tp + t for t in range(tp)] for d in range(dp)],
            [[d * tp + t for d in range(dp)] for t in range(tp)])


def build_groups(cfg, rank: int) -> tuple[Any, Any, int]:
    """(tensor-parallel group, data-parallel group, data-parallel index) of this rank; the world
    (None) for an axis of size one. Collective: every rank creates every group, in one order."""
    import torch.distributed as dist

    if cfg.tp == 1:
        return None, None, rank
    tp_groups, dp_groups = rank_groups(cfg.world_size, cfg.tp)
    mine = {}
    for axis, groups in (("tp", tp_groups), ("dp", dp_groups)):
        for ranks in groups:
            group = dist.new_group(ranks)
            if rank in ranks:
                mine[axis] = group
    return mine["tp"], mine["dp"], rank // cfg.tp


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
