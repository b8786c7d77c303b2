"""A schedule lowered onto the shared discrete-event core (:mod:`commlab.sim`): predicted step time.

Every action becomes a task on its rank's compute resource (``rank{r}``), in the rank's order,
lasting its compute time plus the executor's per-action overhead; a checkpointed micro-batch's B
(or I) also pays its stage's forward again (recomputation). Every cross-rank message becomes a
task on the channel between the two ranks (``p2p{src}>{dst}``, one message at a time, in the
sender's order) lasting ``alpha + bytes * beta``. A message can start only once it was produced
and once the receiver has posted its receive (:func:`commlab.pipeline.messages.receive_posts`:
on Gloo right after the receiver's previous receiving action): a Gloo send completes only then. The executor also waits on its own
sends before some actions (:func:`commlab.pipeline.messages.send_waits`): those waits are
dependencies too. In a hybrid run each stage's data-parallel all-reduce follows its last backward
on the rank's ``dp{r}`` channel, and the optimizer step follows everything on the rank.

With more ranks than ``cores`` (world 3 on 2 cores), the ranks' compute tasks share one host:
while n of them run, each advances at min(1, cores / n) of its speed (:func:`sharing`, the core's
fluid rate). Messages and all-reduces are not slowed: Gloo waits block in the kernel.

Costs come from calibration (a profiled stage, a point-to-point fit), never from here.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

from commlab.pipeline.actions import BACKWARD, FORWARD, INPUT_GRAD, WEIGHT_GRAD, Action, Actions, num_microbatches, num_stages, placement_of
from commlab.pipeline.messages import consumer, message_order, messages, receive_posts, send_waits
from commlab.pipeline.validate import recomputes
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


def _name(a: Action) -> str:
    return str(a)


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

    ``posting``/``waits``/``contention``: model the receive posting (``lookahead``: as on Gloo,
    see :func:`~commlab.pipeline.messages.receive_posts`; False: NCCL's; the bench passes its backend's,
    the planner plans for Gloo ranks), the executor's send waits and one message at a time per
    channel (the pure schedule analysis of
    :func:`commlab.pipeline.simulate.simulate` turns all three off). ``after``: extra dependencies
    between actions. ``cores``: the host's cores, when the ranks share fewer than one each
    (their compute tasks then get host ``"cpu"``; run with ``rate=sharing(cores)``).
    """
    from commlab.pipeline.simulate import split_stages

    placement = placement_of(actions) if placement is None else tuple(placement)
    stages, split = num_stages(actions), split_stages(actions)
    recomputed = set(checkpointed)
    # A channel carries one message at a time in the sender's order only where the receiver
    # takes them in that order too (NCCL-style); otherwise (Gloo tags) messages do not queue.
    contention = contention and not message_order(actions, placement)
    position = {a: (r, k) for r, rank in enumerate(actions) for k, a in enumerate(rank)}
    # The action after which each cross-rank receive is posted (None: the step's start).
    incoming = {c for *_, c in messages(actions, placement)}
    posted_after: dict[Action, Action | None] = {}
    for rank in actions:
        for j, k in receive_posts([a in incoming for a in rank], lookahead).items():
            posted_after[rank[k]] = rank[j] if j >= 0 else None
    tasks: list[Task] = []
    deps: dict[Action, list[str]] = {a: [] for a in position}
    transfers: list[Task] = []
    for r, rank in enumerate(actions):
        for a in rank:
            c = consumer(a, stages, split)
            if c is None or c not in position:
                continue
            dst = position[c][0]
            if dst == r:
                deps[c].append(_name(a))
                continue
            before = posted_after.get(c)
            posted = (_name(before),) if posting and before is not None else ()
            size = costs.message_bytes[min(a.stage, c.stage)] if costs.message_bytes else 0.0
            channel = f"p2p{r}>{dst}" if contention else f"msg {a}>{c}"
            msg = Task(f"msg {a}>{c}", channel, costs.alpha + size * costs.beta, (_name(a), *posted), kind="p2p")
            transfers.append(msg)
            deps[c].append(msg.name)
    if waits:
        by_producer = {m.deps[0]: m.name for m in transfers}
        for before, sent in send_waits(actions, placement).items():
            deps[before] += [by_producer[_name(s)] for s in sent if _name(s) in by_producer]
    for a, extra in (after or {}).items():
        deps[a] += [_name(e) for e in extra]
    share = {FORWARD: 0.0, BACKWARD: 1.0, INPUT_GRAD: 1.0 - costs.weight_share, WEIGHT_GRAD: costs.weight_share}
    for r, rank in enumerate(actions):
        for a in rank:
            if a in costs.durations:
                seconds = costs.durations[a]
            else:
                seconds = costs.forward[a.stage] if a.kind == FORWARD else costs.backward[a.stage] * share[a.kind]
                if a.kind in (BACKWARD, INPUT_GRAD) and a.microbatch in recomputed:
                    seconds += costs.forward[a.stage]
            tasks.append(Task(_name(a), f"rank{r}", seconds + costs.overhead, tuple(deps[a]), kind=a.kind,
                              meta={"rank": r, "action": a}))  # fmt: skip
    tasks += transfers
    tasks += _tail(actions, costs, placement)
    if shared(len(actions), cores):
        tasks = [replace(t, host="cpu") if t.resource.startswith("rank") else t for t in tasks]
    return tasks


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
        last = {a.stage: _name(a) for a in rank if a.kind in (BACKWARD, WEIGHT_GRAD)}
        reduce = [Task(f"allreduce {s}", f"dp{r}", costs.allreduce[s], (last[s],), kind="allreduce")
                  for s in sorted(last, reverse=True) if costs.allreduce]  # fmt: skip
        out += reduce
        if costs.optimizer:
            out.append(Task(f"optimizer {r}", f"rank{r}", costs.optimizer, tuple(t.name for t in reduce) + (_name(rank[-1]),), kind="optimizer"))
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
    """The micro-batches a checkpoint mode recomputes (:func:`commlab.pipeline.validate.recomputes`)."""
    return tuple(i for i in range(microbatches) if recomputes(mode, i, microbatches))


__all__ = ["Costs", "Prediction", "checkpointed_microbatches", "lower", "num_microbatches", "predict", "shared", "sharing"]
