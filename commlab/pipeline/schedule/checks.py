"""Checks that a schedule can run: complete, ordered, placed on the right ranks, deadlock-free.

:func:`check_schedule` raises ValueError naming every problem it finds, before any process starts; it
accepts any per-rank action lists (made here, by hand, or by torch.distributed.pipelining) and
checks them against the micro-batches, stages and placement the caller expects.
"""

from __future__ import annotations

from collections.abc import Sequence

from commlab.pipeline.schedule.actions import (
    BACKWARD,
    FORWARD,
    INPUT_GRAD,
    WEIGHT_GRAD,
    Action,
    Actions,
    as_actions,
    check_placement,
    flatten,
    num_microbatches,
    num_stages,
    placement_of,
)
from commlab.pipeline.schedule.clock import DeadlockError, walk
from commlab.pipeline.schedule.comm import BACKENDS, RECV, SEND, WAIT, Comm, Lowered, Message, lower_comm, message_order
from commlab.pipeline.schedule.kinds import dependencies, split_stages
from commlab.pipeline.schedule.registry import spec

__all__ = ["CHECKPOINT_MODES", "check_plan", "comm_problems", "message_order", "problems", "recomputes", "resolve", "check_schedule"]

CHECKPOINT_MODES = ("never", "except_last", "always")


def recomputes(mode: str, microbatch: int, microbatches: int) -> bool:
    """Whether checkpoint ``mode`` recomputes ``microbatch``'s forward during its backward:
    ``always`` every micro-batch, ``except_last`` all but the last (whose backward follows its
    forward at once on the last stage), ``never`` none. The executor and the predictor both ask here."""
    if mode not in CHECKPOINT_MODES:
        raise ValueError(f"unknown checkpoint mode {mode!r}: choose from {', '.join(CHECKPOINT_MODES)}")
    return mode == "always" or (mode == "except_last" and microbatch < microbatches - 1)


def problems(
    actions: Actions,
    microbatches: int | None = None,
    stages: int | None = None,
    placement: Sequence[int] | None = None,
) -> list[str]:
    """Every rule the schedule breaks, as sentences (empty when it is valid)."""
    if not actions or not any(actions):
        return ["the schedule has no actions"]
    ranks = len(actions)
    found: list[str] = []
    have_stages, have_mb = num_stages(actions), num_microbatches(actions)
    if stages is not None and have_stages != stages:
        found.append(f"the schedule has {have_stages} stages, expected {stages}")
    if microbatches is not None and have_mb != microbatches:
        found.append(f"the schedule has {have_mb} micro-batches, expected {microbatches}")
    stages = max(have_stages, stages or 0)
    microbatches = max(have_mb, microbatches or 0)
    if placement is None:
        placement = placement_of(actions)
    else:
        try:
            placement = check_placement(placement, ranks, stages)
        except ValueError as err:
            return found + [str(err)]
    idle = [r for r, rank in enumerate(actions) if not rank]
    if idle:
        found.append(f"ranks {idle} have no actions")
    actions = flatten(actions)  # from here on an overlap is its parts, in order
    split = split_stages(actions)
    seen: set[Action] = set()
    for r, rank_actions in enumerate(actions):
        position: dict[Action, int] = {}
        for k, a in enumerate(rank_actions):
            if a.stage < len(placement) and placement[a.stage] != r:
                found.append(f"rank {r} runs {a}, but stage {a.stage} lives on rank {placement[a.stage]}")
            if a in seen:
                found.append(f"{a} appears twice")
            seen.add(a)
            position[a] = k
        for a, k in position.items():
            for d in dependencies(a, stages, split):
                # A dependency on this rank must already have run, or the rank waits on itself.
                if d in position and position[d] > k:
                    why = ("stage order" if d.stage != a.stage
                           else "forward before its backward" if d.kind == FORWARD and a.kind in (BACKWARD, INPUT_GRAD)
                           else "I before its W" if d.kind == INPUT_GRAD else f"{d.kind} before {a.kind}")  # fmt: skip
                    found.append(f"rank {r} runs {a} before {d} ({why}): it would wait on itself")
    for s in range(stages):
        for i in range(microbatches):
            if Action(s, FORWARD, i) not in seen:
                found.append(f"{Action(s, FORWARD, i)} is missing")
            full, inp, wgt = (Action(s, k, i) in seen for k in (BACKWARD, INPUT_GRAD, WEIGHT_GRAD))
            if full and (inp or wgt):
                found.append(f"stage {s} micro-batch {i} has both B and I/W: run B, or I then W")
            elif not full and not (inp and wgt):
                missing = Action(s, BACKWARD, i) if not (inp or wgt) else Action(s, WEIGHT_GRAD if inp else INPUT_GRAD, i)
                found.append(f"{missing} is missing")
    if not found:  # any kind: what an action needs must run somewhere, or its rank waits forever
        found += sorted({f"{a} needs {d}, which no rank runs" for a in seen for d in dependencies(a, stages, split) if d not in seen})
    if not found:
        try:
            walk(actions)
        except DeadlockError as err:
            found.append(str(err))
    if not found:  # the lists the executor runs: every wait finds what it waits for, on either backend
        for backend in BACKENDS:
            found += [f"{backend}: {p}" for p in comm_problems(lower_comm(actions, placement, backend))]
    return found


def comm_problems(lowered: Lowered) -> list[str]:
    """Why lowered lists would hang (empty if they run): a ``WAIT RECV`` needs its SEND issued and
    its own RECV posted, a ``WAIT SEND`` its RECV posted (a Gloo send completes only then), every
    SEND one RECV."""
    sends = [op.message for rank in lowered for op in rank if isinstance(op, Comm) and op.kind == SEND]
    recvs = [op.message for rank in lowered for op in rank if isinstance(op, Comm) and op.kind == RECV]
    if sorted(map(str, sends)) != sorted(map(str, recvs)):
        return [f"sends {sorted(map(str, sends))} do not match receives {sorted(map(str, recvs))}"]
    issued: set[tuple[str, Message]] = set()
    nxt = [0] * len(lowered)
    while any(k < len(rank) for k, rank in zip(nxt, lowered)):
        moved = False
        for r, rank in enumerate(lowered):
            while nxt[r] < len(rank):
                op = rank[nxt[r]]
                # A wait needs the peer's side issued (and a receive its own post before it).
                if isinstance(op, Comm) and op.kind == WAIT and not {(RECV, op.message), (op.of, op.message)} | (
                        {(SEND, op.message)} if op.of == RECV else set()) <= issued:  # fmt: skip
                    break
                if isinstance(op, Comm) and op.kind != WAIT:
                    issued.add((op.kind, op.message))
                nxt[r], moved = nxt[r] + 1, True
        if not moved:
            waiting = {r: str(rank[k]) for r, (k, rank) in enumerate(zip(nxt, lowered)) if k < len(rank)}
            return [f"the communication deadlocks: ranks wait forever at {waiting}"]
    return []


def check_schedule(
    actions: Actions,
    microbatches: int | None = None,
    stages: int | None = None,
    placement: Sequence[int] | None = None,
) -> None:
    """Raise ValueError listing every problem; return None for a runnable schedule."""
    found = problems(actions, microbatches, stages, placement)
    if found:
        raise ValueError("invalid pipeline schedule:\n  " + "\n  ".join(found))


def resolve(schedule, ranks: int, microbatches: int, stages: int, placement: Sequence[int] | None = None) -> Actions:
    """The checked per-rank actions of ``schedule`` (a registered name or per-rank action lists)."""
    if isinstance(schedule, str):
        found = spec(schedule)
        if stages % ranks:
            raise ValueError(f"{stages} stages do not divide evenly over {ranks} pipeline ranks")
        found.check(ranks, microbatches, stages // ranks)
        want = found.placement(ranks, stages)
        if placement is not None and tuple(placement) != tuple(want):
            raise ValueError(f"schedule {schedule!r} places stages on ranks {list(want)}, but the stage was built "
                             f"with placement {list(placement)}: pass RankStages(..., placement={list(want)})")  # fmt: skip
        actions = found.build(ranks, microbatches, stages // ranks)
    else:
        actions = as_actions(schedule)
        if len(actions) != ranks:
            raise ValueError(f"the schedule lists actions for {len(actions)} ranks, the pipeline has {ranks}")
    check_schedule(actions, microbatches, stages, placement)
    return actions


def check_plan(schedule, stages: int, ranks: int, microbatches: int, checkpoint: str = "never",
               placement: Sequence[int] | None = None) -> int:  # fmt: skip
    """Validate a pipeline configuration before any process starts; return v (stages per rank)."""
    if checkpoint not in CHECKPOINT_MODES:
        raise ValueError(f"unknown checkpoint mode {checkpoint!r}: choose from {', '.join(CHECKPOINT_MODES)}")
    if microbatches < 1:
        raise ValueError(f"micro-batches must be >= 1, got {microbatches}")
    if stages < ranks:
        raise ValueError(f"{stages} stages for {ranks} pipeline ranks: every rank needs a stage")
    resolve(schedule, ranks, microbatches, stages, placement)
    return stages // ranks
