"""Pipeline parallelism: schedules as data, their comm pass and simulator, the executor, balancing.

    from commlab.pipeline import PipelineExecutor, RankStages
    stages = RankStages(model, balance=[3, 2])                # this rank's part of an nn.Sequential
    pipe = PipelineExecutor(stages, "1f1b", microbatches=8, loss_fn=F.cross_entropy)
    loss = pipe.step(x, target=y)                            # x on the first rank, y on the last

    stages = RankStages(gpt, split_points=["layers.4"], example_args=(tokens[:2],),
                        example_kwargs={"attention_mask": mask[:2]})   # any module, cut by tracing
    pipe = PipelineExecutor(stages, "1f1b", microbatches=4, loss_fn=lm_loss)
    pipe.step(tokens, attention_mask=mask, target=y, losses=losses)   # torch's call
    logits = pipe.eval_step(tokens, attention_mask=mask)             # merged, on the last rank

Schedules (``gpipe``, ``1f1b``, ``interleaved``, ``zb-h1``, ``zb-v``, ``looped-bfs``,
``interleaved-zb``, ``dualpipev``; :data:`REGISTRY`), or any per-rank action lists
(``[["0F0", "0B0"], ...]``, :func:`from_csv` for torch's CSV), the comm pass
:func:`lower_comm`, :func:`check_schedule`, :func:`simulate` and :func:`grid` are pure functions of the
pipeline's shape (:mod:`commlab.pipeline.schedule`); the executor and what it runs on are in
:mod:`commlab.pipeline.runtime`. ``PipelineSchedule`` and ``Stage``, the old names of
``PipelineExecutor`` and ``RankStages``, still work with a FutureWarning.
"""

from __future__ import annotations

from commlab._lazy import lazy_getattr, renamed_getattr

from commlab.pipeline.runtime.partition import balance_by_size, balance_by_time, partition, split
from commlab.pipeline.schedule.actions import Action, as_actions, flatten, format_actions, from_csv, looping, overlap, placement_of, to_csv, v_shape
from commlab.pipeline.schedule.clock import DeadlockError
from commlab.pipeline.schedule.comm import lower_comm, message_order, send_waits
from commlab.pipeline.schedule.kinds import KINDS, Kind, dependencies, register_kind
from commlab.pipeline.schedule.liveness import liveness, peak_in_flight
from commlab.pipeline.schedule.registry import REGISTRY, SCHEDULES, ScheduleSpec, build, gpipe, interleaved, one_f_one_b, register
from commlab.pipeline.schedule.render import grid
from commlab.pipeline.schedule.simulate import Simulation, bubble_formula, simulate
from commlab.pipeline.schedule.checks import CHECKPOINT_MODES, check_plan, check_schedule, resolve
from commlab.pipeline.schedule.zero_bubble import dualpipev, zb_h1, zb_v

# The runtime needs torch, which costs seconds to import: these names load on first use, so that
# `commlab pipeline --help` and the pure schedule functions stay fast.
_LAZY = {
    "LOSS_REDUCTIONS": "commlab.pipeline.runtime.executor",
    "PipelineExecutor": "commlab.pipeline.runtime.executor",
    "RankStages": "commlab.pipeline.runtime.stages",
    "DataParallelStage": "commlab.pipeline.runtime.hybrid",
    "trace_stages": "commlab.pipeline.runtime.traced",
}


# The old names, for a release: the executor runs a schedule (it is not one); RankStages holds
# all of a rank's stages, not one; "validate" means the model against measurement (commlab.validation).
RENAMED = {"PipelineSchedule": "PipelineExecutor", "Stage": "RankStages", "validate": "check_schedule"}
__getattr__ = renamed_getattr("commlab.pipeline", RENAMED, lazy_getattr("commlab.pipeline", _LAZY))


__all__ = sorted([
    "CHECKPOINT_MODES", "KINDS", "REGISTRY", "SCHEDULES", "Action", "DeadlockError", "Kind", "ScheduleSpec",
    "Simulation", "as_actions", "balance_by_size", "balance_by_time", "bubble_formula", "build", "check_plan", "check_schedule", "dependencies", "format_actions", "from_csv",
    "gpipe", "grid", "interleaved", "liveness", "looping", "lower_comm", "message_order", "one_f_one_b",
    "partition", "peak_in_flight", "placement_of", "register", "register_kind", "resolve", "send_waits", "simulate", "split", "to_csv",
    "v_shape", "zb_h1", "zb_v", "dualpipev", "flatten", "overlap", *_LAZY,
])  # fmt: skip
