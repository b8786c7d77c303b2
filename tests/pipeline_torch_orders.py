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
