"""Pulling a split backward's W next to its own I where the simulated step does not grow.

The executor runs an I directly followed by its own W as one autograd pass
(:func:`commlab.pipeline.runtime.compute.full_grad`), as torch.distributed.pipelining's
``_merge_bw`` turns such a pair into one full backward (torch/distributed/pipelining/schedules.py).
One pass costs less than I and W apart: W restarts autograd at each weight node, and by the time
it runs the activations it reads have left the cache. On the GPT's blocks (width 256, micro-batch
8 x 32, world size 2, Gloo) a fused pair took 7.0-8.3 ms in the executor's timeline, I then W
apart 8.3-9.6 ms (9.3-10.2 before W called autograd's engine directly,
:mod:`commlab.pipeline.runtime.weight_split`). A zero-bubble list built on equal-time actions
cannot see that saving, so it defers W's that it could have run at once for free.

:func:`pull_weights` takes such a list and, rank by rank in list order, moves each I's W to just
after it when the step simulated with fused pairs at :data:`FUSED` of their parts' time
(:func:`step_time`) is no longer. W's wait for nothing and send nothing, so a move never breaks
a dependency, and it frees activations sooner; W's of one stage may then run out of micro-batch
order.
"""

from __future__ import annotations

from commlab.pipeline.schedule.actions import FORWARD, INPUT_GRAD, WEIGHT_GRAD, Action, Actions, num_stages
from commlab.pipeline.schedule.kinds import dependencies, split_stages

FUSED = 0.85  # a fused I + W's time as a share of I then W apart (module docstring's measurement)


def fused(rank: tuple[Action, ...] | list[Action], k: int) -> bool:
    """Whether action ``k`` of one rank's list is an I directly followed by its own W."""
    a = rank[k]
    return a.kind == INPUT_GRAD and k + 1 < len(rank) and rank[k + 1] == a.at(a.stage, WEIGHT_GRAD)


def durations(actions: Actions, forward: float = 1.0, backward: float = 2.0, share: float = FUSED) -> dict[Action, float]:
    """Each action's time with F = ``forward``, I = W = ``backward`` / 2, and a fused pair's whole
    time ``share`` x ``backward`` on its I (its W then takes none)."""
    out: dict[Action, float] = {}
    for rank in actions:
        for k, a in enumerate(rank):
            if a in out:
                continue
            if fused(rank, k):
                out[a], out[rank[k + 1]] = share * backward, 0.0
            else:
                out[a] = forward if a.kind == FORWARD else backward / 2
    return out


def step_time(actions: Actions, seconds: dict[Action, float], comm: float) -> float:
    """When the last action ends: each rank runs its list in order, an action starts when its rank
    is free and what it needs (:func:`~commlab.pipeline.schedule.kinds.dependencies`) has ended,
    ``comm`` later if on another rank. :func:`~commlab.pipeline.schedule.simulate.simulate`'s
    step time without its comm pass, fast enough to try one move per I (ValueError on a deadlock)."""
    stages, split = num_stages(actions), split_stages(actions)
    where = {a: r for r, rank in enumerate(actions) for a in rank}
    needs = {a: dependencies(a, stages, split) for a in where}
    end: dict[Action, float] = {}
    at, free = [0] * len(actions), [0.0] * len(actions)
    moved = True
    while moved:
        moved = False
        for r, rank in enumerate(actions):
            while at[r] < len(rank) and all(d in end for d in needs[rank[at[r]]]):
                a = rank[at[r]]
                start = max([free[r], *(end[d] + (comm if where[d] != r else 0.0) for d in needs[a])])
                end[a] = free[r] = start + seconds[a]
                at[r] += 1
                moved = True
    if any(at[r] < len(rank) for r, rank in enumerate(actions)):
        raise ValueError("the schedule deadlocks: " + ", ".join(str(rank[at[r]]) for r, rank in enumerate(actions) if at[r] < len(rank)))
    return max(free)


def pull_weights(actions: Actions, comm: float = 0.3) -> Actions:
    """``actions`` with each W moved next to its I where that costs nothing (module docstring);
    ``comm``: a message's time as a share of a forward. A list with other kinds (B, O) is returned
    as it is."""
    if any(a.kind not in (FORWARD, INPUT_GRAD, WEIGHT_GRAD) for rank in actions for a in rank):
        return actions
    lists = [list(rank) for rank in actions]
    best = step_time(actions, durations(actions), comm)
    for r in range(len(lists)):
        for a in [x for x in actions[r] if x.kind == INPUT_GRAD]:
            rank = lists[r]
            k, w = rank.index(a), a.at(a.stage, WEIGHT_GRAD)
            if w not in rank or fused(rank, k):
                continue
            trial = [x for x in rank if x != w]
            trial.insert(k + 1, w)
            candidate = tuple(tuple(x) for x in [*lists[:r], trial, *lists[r + 1 :]])
            cost = step_time(candidate, durations(candidate), comm)
            if cost <= best + 1e-9:
                lists[r], best = trial, cost
    return tuple(tuple(rank) for rank in lists)
