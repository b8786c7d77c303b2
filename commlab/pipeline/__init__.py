"""Pipeline parallelism: schedules as data, their simulator, stages, the executor, balancing.

    from commlab.pipeline import Stage, PipelineSchedule
    stage = Stage(model, balance=[3, 2])                      # this rank's part of an nn.Sequential
    pipe = PipelineSchedule(stage, "1f1b", microbatches=8, loss_fn=F.cross_entropy)
    loss = pipe.step(x, target=y)                            # x on the first rank, y on the last

Schedules (``gpipe``, ``one_f_one_b``, ``interleaved``), :func:`validate`, :func:`simulate` and
:func:`grid` are pure functions of the pipeline's shape; see docs/design.md, section "pipeline".
"""

from commlab.pipeline.executor import CHECKPOINT_MODES, PipelineSchedule, check_plan
from commlab.pipeline.hybrid import DataParallelStage
from commlab.pipeline.partition import balance_by_size, balance_by_time, partition, split
from commlab.pipeline.render import grid
from commlab.pipeline.schedules import SCHEDULES, Action, build, format_actions, gpipe, interleaved, one_f_one_b
from commlab.pipeline.simulate import DeadlockError, Simulation, bubble_formula, peak_in_flight, simulate
from commlab.pipeline.stage import Stage
from commlab.pipeline.validate import message_order, validate

__all__ = [
    "CHECKPOINT_MODES",
    "SCHEDULES",
    "Action",
    "DataParallelStage",
    "DeadlockError",
    "PipelineSchedule",
    "Simulation",
    "Stage",
    "balance_by_size",
    "balance_by_time",
    "bubble_formula",
    "build",
    "check_plan",
    "format_actions",
    "gpipe",
    "grid",
    "interleaved",
    "message_order",
    "one_f_one_b",
    "partition",
    "peak_in_flight",
    "simulate",
    "split",
    "validate",
]
