"""Checks that a schedule can run: complete, ordered, placed on the right ranks, deadlock-free.

:func:`validate` raises ValueError naming every problem it finds, before any process starts.
:func:`message_order` checks the stricter property that NCCL needs: on every pair of ranks, the
receiver consumes messages in the order the sender produced them (NCCL matches point-to-point
operations by issue order, not by tag).
"""

from __future__ import annotations

from commlab.pipeline.schedules import BACKWARD, FORWARD, Action, Actions, num_stages, stage_rank
from commlab.pipeline.simulate import DeadlockError, dependencies, simulate


def problems(actions: Actions) -> list[str]:
    """Every rule the schedule breaks, as sentences (empty when it is valid)."""
    if not actions or not any(actions):
        return ["the schedule has no actions"]
    ranks = len(actions)
    stages = num_stages(actions)
    found: list[str] = []
    if stages % ranks:
        found.append(f"{stages} stages do not divide evenly over {ranks} ranks")
    seen: dict[Action, int] = {}
    for r, rank_actions in enumerate(actions):
        position: dict[Action, int] = {}
        for k, a in enumerate(rank_actions):
            if stage_rank(a.stage, ranks) != r:
                found.append(f"rank {r} runs {a}, but stage {a.stage} lives on rank {stage_rank(a.stage, ranks)}")
            if a in seen:
                found.append(f"{a} appears twice")
            seen[a] = r
            position[a] = k
        for a, k in position.items():
            for d in dependencies(a, stages):
                # A dependency on this rank must already have run, or the rank waits on itself.
                if d in position and position[d] > k:
                    why = "forward before its backward" if a.kind == BACKWARD and d.stage == a.stage else "stage order"
                    found.append(f"rank {r} runs {a} before {d} ({why}): it would wait on itself")
    microbatches = 1 + max(a.microbatch for a in seen)
    for s in range(stages):
        for i in range(microbatches):
            for kind in (FORWARD, BACKWARD):
                if Action(s, kind, i) not in seen:
                    found.append(f"{Action(s, kind, i)} is missing")
    if not found:
        try:
            simulate(actions, 1.0, 1.0)
        except DeadlockError as err:
            found.append(str(err))
    return found


def validate(actions: Actions) -> None:
    """Raise ValueError listing every problem; return None for a runnable schedule."""
    found = problems(actions)
    if found:
        raise ValueError("invalid pipeline schedule:\n  " + "\n  ".join(found))


def message_order(actions: Actions) -> list[str]:
    """Pairs of ranks whose messages would be received in a different order than sent.

    A forward of stage s sends its activation to stage s+1; a backward of stage s sends the input
    gradient to stage s-1. Returns one sentence per mismatched (sender, receiver) pair.
    """
    ranks = len(actions)
    stages = num_stages(actions)
    sent: dict[tuple[int, int], list[str]] = {}
    received: dict[tuple[int, int], list[str]] = {}
    for r, rank_actions in enumerate(actions):
        for a in rank_actions:
            src = a.stage - 1 if a.kind == FORWARD else a.stage + 1
            dst = a.stage + 1 if a.kind == FORWARD else a.stage - 1
            tag = f"{a.kind}{a.microbatch}"
            if 0 <= src < stages and stage_rank(src, ranks) != r:
                received.setdefault((stage_rank(src, ranks), r), []).append(f"{src}->{a.stage}:{tag}")
            if 0 <= dst < stages and stage_rank(dst, ranks) != r:
                sent.setdefault((r, stage_rank(dst, ranks)), []).append(f"{a.stage}->{dst}:{tag}")
    return [
        f"rank {src} sends {sent.get((src, dst))} but rank {dst} receives {received.get((src, dst))}"
        for src, dst in sorted(set(sent) | set(received))
        if sent.get((src, dst)) != received.get((src, dst))
    ]
