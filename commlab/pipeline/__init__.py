"""Pipeline parallelism: schedules as data, their simulator, stages, the executor, balancing.

    from commlab.pipeline import Stage, PipelineSchedule
    stage = Stage(model, balance=[3, 2])                      # this rank's part of an nn.Sequential
    pipe = PipelineSchedule(stage, "1f1b", microbatches=8, loss_fn=F.cross_entropy)
    loss = pipe.step(x, target=y)                            # x on the first rank, y on the last

Schedules (``gpipe``, ``1f1b``, ``interleaved``, ``zb-h1``, ``zb-v``; :data:`REGISTRY`), or any
per-rank action lists (``[["0F0", "0B0"], ...]``, :func:`from_csv` for torch's CSV), :func:`validate`,
:func:`simulate` and :func:`grid` are pure functions of the pipeline's shape; see docs/design.md,
section "pipeline".
"""

from commlab.pipeline.actions import Action, as_actions, format_actions, from_csv, looping, placement_of, to_csv, v_shape
from commlab.pipeline.executor import CHECKPOINT_MODES, LOSS_REDUCTIONS, PipelineSchedule, check_plan, resolve
from commlab.pipeline.hybrid import DataParallelStage
from commlab.pipeline.messages import message_order, send_waits
from commlab.pipeline.partition import balance_by_size, balance_by_time, partition, split
from commlab.pipeline.render import grid
from commlab.pipeline.schedules import REGISTRY, SCHEDULES, ScheduleSpec, build, gpipe, interleaved, one_f_one_b, register
from commlab.pipeline.simulate import DeadlockError, Simulation, bubble_formula, peak_in_flight, simulate
from commlab.pipeline.stage import Stage
from commlab.pipeline.validate import validate
from commlab.pipeline.zero_bubble import zb_h1, zb_v

__all__ = [
    "CHECKPOINT_MODES",
    "LOSS_REDUCTIONS",
    "REGISTRY",
    "SCHEDULES",
    "Action",
    "DataParallelStage",
    "DeadlockError",
    "PipelineSchedule",
    "ScheduleSpec",
    "Simulation",
    "Stage",
    "as_actions",
    "balance_by_size",
    "balance_by_time",
    "bubble_formula",
    "build",
    "check_plan",
    "format_actions",
    "from_csv",
    "gpipe",
    "grid",
    "interleaved",
    "looping",
    "message_order",
    "one_f_one_b",
    "partition",
    "peak_in_flight",
    "placement_of",
    "register",
    "resolve",
    "send_waits",
    "simulate",
    "split",
    "to_csv",
    "v_shape",
    "validate",
    "zb_h1",
    "zb_v",
]
