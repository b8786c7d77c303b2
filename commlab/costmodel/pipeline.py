"""The cost lowering: a schedule's comm-pass lists priced on the shared discrete-event core (:mod:`commlab.sim`).

The lists come from :func:`commlab.pipeline.schedule.comm.lower_comm` and go on the core by
:func:`commlab.pipeline.schedule.tasks.tasks`; this module prices them. Every action lasts its
kind's compute time (``Kind.seconds`` of its stage's forward and backward) plus the executor's
per-action overhead; a checkpointed micro-batch's B (or I: ``Kind.recomputes``) also pays its
stage's forward again. Every cross-rank message lasts ``alpha + bytes * beta`` on the channel
between the two ranks; it starts once produced and once the receiver's RECV is posted (a Gloo
send completes only then), and the executor's WAITs on its own sends are dependencies too. In a hybrid run each stage's data-parallel all-reduce follows its last backward
on the rank's ``dp{r}`` channel, and the optimizer step follows everything on the rank.

With more ranks than ``cores`` (world 3 on 2 cores), the ranks' compute tasks share one host:
while n of them run, each advances at min(1, cores / n) of its speed (:func:`sharing`, the core's
fluid rate). Messages and all-reduces are not slowed: Gloo waits block in the kernel.

Costs come from calibration (a profiled stage, a point-to-point fit), never from here.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

from commlab.pipeline.schedule.actions import Action, Actions, num_microbatches, placement_of
from commlab.pipeline.schedule.comm import Message, lower_comm
from commlab.pipeline.schedule.kinds import KINDS
from commlab.pipeline.schedule.tasks import tasks
from commlab.pipeline.schedule.validate import recomputes
from commlab.sim import SimResult, Task
from commlab.sim import simulate as run_tasks


@dataclass(frozen=True)
class Costs:
    """Seconds per action of each stage, and what the rest of a step costs.

    ``forward[s]``/``backward[s]``: one micro-batch on stage s (B = I + W; W takes
    ``weight_share`` of it). ``message_bytes[s]``: the boundary after stage s per micro-batch
    (activations forward, the same size of gradients back). ``alpha``/``beta``: seconds per message
    and per byte. ``overhead``: the executor's own time per action. ``allreduce[s]``: stage s's
    data-parallel all-reduce tail; ``optimizer``: the optimizer step per rank.
    """

    forward: Sequence[float]
    backward: Sequence[float]
    weight_share: float = 0.5
    message_bytes: Sequence[float] = ()
    alpha: float = 0.0
    beta: float = 0.0
    overhead: float = 0.0
    allreduce: Sequence[float] = ()
    optimizer: float = 0.0
    durations: Mapping[Action, float] = field(default_factory=dict)  # overrides, e.g. one measured step


def lower(
    actions: Actions,
    costs: Costs,
    placement: Sequence[int] | None = None,
    checkpointed: Sequence[int] = (),
    *,
    posting: bool = True,
    lookahead: bool = True,
    waits: bool = True,
    contention: bool = True,
    after: Mapping[Action, Sequence[Action]] | None = None,
    cores: int | None = None,
) -> list[Task]:
    """The tasks of one step. ``checkpointed``: micro-batches whose forward is recomputed.

    The comm pass's lists (:func:`~commlab.pipeline.schedule.comm.lower_comm`; ``lookahead``:
    Gloo's receive posting, False: NCCL's; the bench passes its backend's, the planner plans for
    Gloo ranks) go on the core by :func:`~commlab.pipeline.schedule.tasks.tasks`, priced here.
    ``posting``/``waits``/``contention``: model the receive posting, the executor's send waits and
    one message at a time per channel. ``after``: extra dependencies between actions. ``cores``:
    the host's cores, when the ranks share fewer than one each (their compute tasks then get host
    ``"cpu"``; run with ``rate=sharing(cores)``).
    """
    placement = placement_of(actions) if placement is None else tuple(placement)
    recomputed = set(checkpointed)

    def seconds(a: Action) -> float:
        kind = KINDS[a.kind]
        if a in costs.durations:
            return costs.durations[a] + costs.overhead
        own = kind.seconds(costs.forward[a.stage], costs.backward[a.stage], costs.weight_share)
        if kind.recomputes and a.microbatch in recomputed:
            own += costs.forward[a.stage]
        return own + costs.overhead

    def message_seconds(m: Message) -> float:
        size = costs.message_bytes[min(m.sent_by.stage, m.taken_by.stage)] if costs.message_bytes else 0.0
        return costs.alpha + size * costs.beta

    lowered = lower_comm(actions, placement, "gloo" if lookahead else "nccl")
    out = tasks(lowered, seconds, message_seconds, posting=posting, waits=waits, contention=contention, after=after)
    out += _tail(actions, costs, placement)
    if shared(len(actions), cores):
        out = [replace(t, host="cpu") if t.resource.startswith("rank") else t for t in out]
    return out


def shared(ranks: int, cores: int | None) -> bool:
    """Whether ``ranks`` processes on ``cores`` cores slow each other's compute down."""
    return cores is not None and ranks > cores


def sharing(cores: int):
    """The core's rate function for compute tasks on ``cores`` cores: n running tasks each get
    min(1, cores / n) (the OS shares cores fairly among runnable single-threaded ranks)."""
    if cores < 1:
        raise ValueError(f"cores must be >= 1, got {cores}")
    return lambda task, others: min(1.0, cores / (1 + len(others)))


def _tail(actions: Actions, costs: Costs, placement: Sequence[int]) -> list[Task]:
    """The data-parallel all-reduce of each stage after its last backward, then the optimizer."""
    if not costs.allreduce and not costs.optimizer:
        return []
    out: list[Task] = []
    for r, rank in enumerate(actions):
        last = {a.stage: str(a) for a in rank if KINDS[a.kind].stash < 0}  # the stage's last backward
        reduce = [Task(f"allreduce {s}", f"dp{r}", costs.allreduce[s], (last[s],), kind="allreduce")
                  for s in sorted(last, reverse=True) if costs.allreduce]  # fmt: skip
        out += reduce
        if costs.optimizer:
            out.append(Task(f"optimizer {r}", f"rank{r}", costs.optimizer, tuple(t.name for t in reduce) + (str(rank[-1]),), kind="optimizer"))
    return out


@dataclass(frozen=True)
class Prediction:
    step_time: float
    result: SimResult


def predict(actions: Actions, costs: Costs, placement: Sequence[int] | None = None, checkpointed: Sequence[int] = (),
            cores: int | None = None, lookahead: bool = True) -> Prediction:  # fmt: skip
    """Predicted step time of ``actions`` under ``costs`` on the shared core (``cores``,
    ``lookahead``: see :func:`lower`; the default is Gloo's receive posting)."""
    rate = sharing(cores) if shared(len(actions), cores) else None
    result = run_tasks(lower(actions, costs, placement, checkpointed, cores=cores, lookahead=lookahead), rate)
    return Prediction(result.makespan, result)


def checkpointed_microbatches(mode: str, microbatches: int) -> tuple[int, ...]:
    """The micro-batches a checkpoint mode recomputes (:func:`commlab.pipeline.schedule.validate.recomputes`)."""
    return tuple(i for i in range(microbatches) if recomputes(mode, i, microbatches))


__all__ = ["Costs", "Prediction", "checkpointed_microbatches", "lower", "num_microbatches", "predict", "shared", "sharing"]
