"""Liveness: which micro-batches' activations each rank holds while each of its actions runs.

One rule (``Kind.stash``): a forward leaves its micro-batch's activations alive on its stage; a
full backward (B) frees them, and so does W after a split backward (I still needs them, W too:
the layers' graphs). With checkpointing, a micro-batch holds only its stage input until the
action that recomputes its forward (B or I: ``Kind.recomputes``), then everything again. The
predicted peak (:func:`commlab.costmodel.planner.plan.peak_bytes`), the activations in flight
(:func:`peak_in_flight`) and the executor's stash and ledger all follow :func:`liveness`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from commlab.pipeline.schedule.actions import Action, Actions, flatten, num_stages
from commlab.pipeline.schedule.kinds import KINDS


@dataclass(frozen=True)
class Live:
    """One compute action and what its rank holds while it runs.

    ``alive``: (stage, micro-batch) -> whether all its activations are held (False: only the stage
    input of a checkpointed micro-batch not yet recomputed); ``freed``: what is released when the
    action ends."""

    action: Action
    alive: dict[tuple[int, int], bool]
    freed: tuple[tuple[int, int], ...]


def liveness(actions: Actions, checkpointed: Sequence[int] = ()) -> tuple[tuple[Live, ...], ...]:
    """Per rank, per compute action in order (an overlap's parts each): what is alive while it
    runs (see :class:`Live`)."""
    recomputed = set(checkpointed)
    out = []
    for rank in flatten(actions):
        held: dict[tuple[int, int], bool] = {}
        lives = []
        for a in rank:
            key, kind = (a.stage, a.microbatch), KINDS[a.kind]
            if kind.stash > 0:
                held[key] = a.microbatch not in recomputed
            elif kind.recomputes and key in held:
                held[key] = True  # the forward re-run for this backward: all its activations again
            freed = (key,) if kind.stash < 0 and key in held else ()
            lives.append(Live(a, dict(held), freed))
            for k in freed:
                del held[k]
        out.append(tuple(lives))
    return tuple(out)


def peak_in_flight(actions: Actions) -> tuple[int, ...]:
    """Per stage, the most micro-batches whose forward ran and whose activations are not yet freed.

    This bounds the activations a stage stashes: m for GPipe, p - s for 1F1B (Narayanan et al.
    2021, section 2.2).
    """
    peak = [0] * num_stages(actions)
    for rank in liveness(actions):
        for live in rank:
            for s in {s for s, _ in live.alive}:
                peak[s] = max(peak[s], sum(1 for t, _ in live.alive if t == s))
    return tuple(peak)
