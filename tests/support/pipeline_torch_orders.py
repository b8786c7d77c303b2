"""Schedules made by torch.distributed.pipelining's own schedule code, without processes.

torch's multi-stage schedules compute every rank's compute order in their constructor from the
stage objects' sizes alone, so stand-in stages with those attributes are enough. The order is
written with torch's own ``PipelineScheduleMulti._dump_csv`` (the compute-only format).
"""

import os
import tempfile

from torch import nn
from torch.distributed.pipelining import schedules as torch_schedules


class _StandIn:
    def __init__(self, index: int, stages: int, ranks: int, rank: int):
        self.stage_index, self.num_stages, self.group_size, self.group_rank = index, stages, ranks, rank
        self.is_first, self.is_last = index == 0, index == stages - 1
        self.submod = nn.Identity()
        self.has_backward = True


def torch_csv(name: str, ranks: int, microbatches: int, stage_indices: list[int], stages: int) -> str:
    """The compute-only CSV torch writes for schedule class ``name`` (rank 0's view: orders are global)."""
    cls = getattr(torch_schedules, name)
    sched = cls([_StandIn(s, stages, ranks, 0) for s in stage_indices], microbatches)
    fd, path = tempfile.mkstemp(suffix=".csv")
    os.close(fd)
    try:
        torch_schedules.PipelineScheduleMulti._dump_csv(sched, path)
        with open(path) as f:
            return f.read()
    finally:
        os.unlink(path)


def torch_dualpipev(ranks: int, microbatches: int, rank: int) -> list[str]:
    """Rank ``rank``'s ScheduleDualPipeV order from torch's own per-rank calculation (which needs
    only the group size and micro-batches), each OVERLAP_F_B pair written as commlab writes its O
    action ("0F2+3B0") and any other full backward as ``I`` then ``W``."""
    sched = object.__new__(torch_schedules.ScheduleDualPipeV)
    sched.pp_group_size, sched._n_microbatches = ranks, microbatches
    kinds = {torch_schedules.FORWARD: ["F"], torch_schedules.FULL_BACKWARD: ["I", "W"],
             torch_schedules.BACKWARD_INPUT: ["I"], torch_schedules.BACKWARD_WEIGHT: ["W"]}  # fmt: skip
    out = []
    for action in sched._calculate_single_rank_operations(rank):
        if action.computation_type == torch_schedules.OVERLAP_F_B:
            f, b = action.sub_actions
            assert b.computation_type == torch_schedules.FULL_BACKWARD
            out.append(f"{f.stage_index}F{f.microbatch_index}+{b.stage_index}B{b.microbatch_index}")
            continue
        out += [f"{action.stage_index}{k}{action.microbatch_index}" for k in kinds[action.computation_type]]
    return out
