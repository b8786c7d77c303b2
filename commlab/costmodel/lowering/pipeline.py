"""The cost lowering: a schedule's comm-pass lists priced on the shared discrete-event core (:mod:`commlab.sim`).

The lists come from :func:`commlab.pipeline.schedule.comm.lower_comm` and go on the core by
:func:`commlab.pipeline.schedule.tasks.tasks`; this module prices them with the one costs type,
:class:`~commlab.costmodel.terms.costs.SystemCosts` (what the machine costs), and a
:class:`~commlab.costmodel.terms.costs.StageProfile` (what each stage computes). Every action lasts
its kind's compute time (``Kind.seconds`` of its stage's forward and backward) plus the
executor's per-action overhead (``Overheads.action_s``); a checkpointed micro-batch's B (or I:
``Kind.recomputes``) also pays its stage's forward again. Every cross-rank message lasts
``SystemCosts.p2p(bytes)`` on the channel between the two ranks; it starts once produced and once
the receiver's RECV is posted (a Gloo send completes only then), and the executor's WAITs on its
own sends are dependencies too.

Lowerings compose: in a hybrid pipeline x data-parallel step (:class:`DataParallel`), each
stage's DDP buckets (:func:`commlab.costmodel.lowering.buckets.assign` over the stage's parameters) follow
its last backward on the rank's ``dp{r}`` channel as :func:`~commlab.costmodel.lowering.buckets.bucket_tasks`,
priced by ``SystemCosts.collective("allreduce", algorithm, world)``; the optimizer step follows
everything on the rank.

With more ranks than ``cores`` (world 3 on 2 cores), the ranks' compute tasks share one host:
while n of them run, each advances at min(1, cores / n) of its speed (:func:`sharing`, the core's
fluid rate). Messages and all-reduces are not slowed: Gloo waits block in the kernel.

Costs come from calibration (a profiled stage, a point-to-point fit), never from here.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from commlab.costmodel.lowering.buckets import DEFAULT_POLICY, assign, bucket_tasks
from commlab.costmodel.terms.costs import StageProfile, SystemCosts
from commlab.pipeline.schedule.actions import Action, Actions, flatten, num_microbatches, placement_of
from commlab.pipeline.schedule.comm import Message, lower_comm
from commlab.pipeline.schedule.kinds import KINDS
from commlab.pipeline.schedule.tasks import tasks
from commlab.pipeline.schedule.checks import recomputes
from commlab.sim import SimResult, Task
from commlab.sim import simulate as run_tasks


@dataclass(frozen=True)
class DataParallel:
    """The data-parallel side of a hybrid step: ``world`` replicas of every stage, each stage
    wrapped in DDP (commlab/pipeline/runtime/hybrid.py) with this bucket policy and all-reduce
    ``algorithm`` (a key of ``SystemCosts.collectives``)."""

    world: int
    algorithm: str = "native"
    policy: Any = DEFAULT_POLICY
    bucket_cap_mb: float | None = None
    first_bucket_mb: float | None = None

    def __post_init__(self) -> None:
        if self.world < 1:
            raise ValueError(f"data-parallel world must be >= 1, got {self.world}")

    def buckets(self, param_nbytes: Sequence[int]) -> list[int]:
        """Bucket sizes in reduction order for one stage's parameters (module order): a stage's
        gradients become ready in reverse module order, as its backward runs."""
        if not param_nbytes:
            return []
        order = list(reversed(range(len(param_nbytes))))
        groups = assign(param_nbytes, order, policy=self.policy, bucket_cap_mb=self.bucket_cap_mb,
                        first_bucket_mb=self.first_bucket_mb)  # fmt: skip
        return [sum(int(param_nbytes[i]) for i in g) for g in groups]


def lower(
    actions: Actions,
    system: SystemCosts,
    profile: StageProfile,
    placement: Sequence[int] | None = None,
    checkpointed: Sequence[int] = (),
    *,
    dp: DataParallel | None = None,
    posting: bool = True,
    lookahead: bool = True,
    waits: bool = True,
    contention: bool = True,
    after: Mapping[Action, Sequence[Action]] | None = None,
    cores: float | None = None,
    durations: Mapping[Action, float] | None = None,
) -> list[Task]:
    """The tasks of one step. ``checkpointed``: micro-batches whose forward is recomputed.

    The comm pass's lists (:func:`~commlab.pipeline.schedule.comm.lower_comm`; ``lookahead``:
    Gloo's receive posting, False: NCCL's; the bench passes its backend's, the planner plans for
    Gloo ranks) go on the core by :func:`~commlab.pipeline.schedule.tasks.tasks`, priced here.
    ``dp``: the hybrid step's data parallelism (None or world 1: none), its buckets after each
    stage's last backward (:func:`step_tail`). ``posting``/``waits``/``contention``: model the
    receive posting, the executor's send waits and one message at a time per channel. ``after``:
    extra dependencies between actions. ``cores``: the host's cores, when the ranks share fewer
    than one each (their compute tasks then get host ``"cpu"``; run with ``rate=sharing(cores)``).
    ``durations``: measured compute seconds of some actions, overriding the profile's.
    """
    placement = placement_of(actions) if placement is None else tuple(placement)
    recomputed = set(checkpointed)
    overrides = durations or {}
    overhead = system.overheads.action_s

    def seconds(a: Action) -> float:
        kind = KINDS[a.kind]
        if a in overrides:
            return overrides[a] + overhead
        own = kind.seconds(profile.forward[a.stage], profile.backward[a.stage], profile.weight_share)
        if kind.recomputes and a.microbatch in recomputed:
            own += profile.forward[a.stage]
        return own + overhead

    def message_seconds(m: Message) -> float:
        size = profile.message_bytes[min(m.sent_by.stage, m.taken_by.stage)] if profile.message_bytes else 0.0
        return system.p2p(size)

    lowered = lower_comm(actions, placement, "gloo" if lookahead else "nccl")
    out = tasks(lowered, seconds, message_seconds, posting=posting, waits=waits, contention=contention, after=after)
    out += step_tail(actions, system, profile, dp)
    if shared(len(actions), cores):
        out = [replace(t, host="cpu") if t.resource.startswith("rank") else t for t in out]
    return out


def step_tail(actions: Actions, system: SystemCosts, profile: StageProfile, dp: DataParallel | None = None) -> list[Task]:
    """What follows the schedule on each rank r: every stage's DDP buckets after the stage's last
    backward (later stages first, as their backwards end first), on channel ``dp{r}`` as tasks
    ``s{stage}.allreduce{k}``; then ``optimizer {r}`` after those and the rank's last action."""
    reduce_on = dp is not None and dp.world > 1
    if not reduce_on and not profile.optimizer_s:
        return []
    if reduce_on and len(profile.param_nbytes) != len(profile.forward):
        raise ValueError(f"data parallelism needs each stage's parameter sizes: {len(profile.param_nbytes)} for "
                         f"{len(profile.forward)} stages")  # fmt: skip
    cost = system.collective("allreduce", dp.algorithm, dp.world) if reduce_on else None
    out: list[Task] = []
    for r, rank in enumerate(flatten(actions)):
        last = {a.stage: str(a) for a in rank if KINDS[a.kind].stash < 0}  # the stage's last backward
        reduce: list[Task] = []
        if reduce_on:
            for s in sorted(last, reverse=True):
                reduce += bucket_tasks(dp.buckets(profile.param_nbytes[s]), cost, after=(last[s],), channel=f"dp{r}",
                                       prefix=f"s{s}.allreduce")  # fmt: skip
        out += reduce
        if profile.optimizer_s:
            out.append(Task(f"optimizer {r}", f"rank{r}", profile.optimizer_s, tuple(t.name for t in reduce) + (str(rank[-1]),),
                            kind="optimizer"))  # fmt: skip
    return out


@dataclass(frozen=True)
class Prediction:
    step_time: float
    result: SimResult


def predict(actions: Actions, system: SystemCosts, profile: StageProfile, placement: Sequence[int] | None = None,
            checkpointed: Sequence[int] = (), cores: float | None = None, lookahead: bool = True,
            dp: DataParallel | None = None, durations: Mapping[Action, float] | None = None) -> Prediction:  # fmt: skip
    """Predicted step time of ``actions`` under ``system`` and ``profile`` on the shared core
    (``cores``, ``lookahead``, ``dp``, ``durations``: see :func:`lower`; the default is Gloo's receive posting)."""
    rate = sharing(cores) if shared(len(actions), cores) else None
    result = run_tasks(lower(actions, system, profile, placement, checkpointed, cores=cores, lookahead=lookahead, dp=dp,
                             durations=durations), rate)  # fmt: skip
    return Prediction(result.makespan, result)


def shared(ranks: int, cores: float | None) -> bool:
    """Whether ``ranks`` processes on ``cores`` cores slow each other's compute down."""
    return cores is not None and ranks > cores


def sharing(cores: float):
    """The core's rate function for compute tasks on ``cores`` cores: n running tasks each get
    min(1, cores / n) (the OS shares cores fairly among runnable single-threaded ranks). A
    fraction is a share of a host that other processes (data-parallel replicas) use too."""
    if not cores > 0:
        raise ValueError(f"cores must be > 0, got {cores}")
    return lambda task, others: min(1.0, cores / (1 + len(others)))


def checkpointed_microbatches(mode: str, microbatches: int) -> tuple[int, ...]:
    """The micro-batches a checkpoint mode recomputes (:func:`commlab.pipeline.schedule.checks.recomputes`)."""
    return tuple(i for i in range(microbatches) if recomputes(mode, i, microbatches))


__all__ = ["DataParallel", "Prediction", "checkpointed_microbatches", "lower", "num_microbatches", "predict", "shared",
           "sharing", "step_tail"]
