"""Action kinds: what each kind needs, sends, keeps alive and costs; the one dependency rule.

A kind is one :class:`Kind` in :data:`KINDS`. The built-in ones are torch.distributed.pipelining's
compute kinds (``_ComputationType``): ``F`` forward, ``B`` full backward, and the zero-bubble
split of ``B`` into ``I`` (gradient of the stage's input, which the previous stage waits for)
and ``W`` (gradient of its weights, which nobody waits for; Qi et al., "Zero Bubble Pipeline
Parallelism", ICLR 2024). A stage runs either ``B`` or ``I`` then ``W`` for each micro-batch.

Every reader asks here: :func:`dependencies` (the validator, the deadlock walk, the comm pass,
the simulators, the zero-bubble builder, calibration), :func:`producer`/:func:`consumer` (which
message an action takes or sends), ``Kind.stash`` (liveness), ``Kind.seconds`` (the cost
lowering). Adding a kind is one :func:`register_kind` call here or in user code, one handler in
the executor's table (:data:`commlab.pipeline.runtime.executor.HANDLERS`), and nothing else
unless its cost needs a term :class:`Kind` does not have. A composite kind needs no handler: the
comm pass, the clock, liveness and the executor run its parts.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

FORWARD, BACKWARD, INPUT_GRAD, WEIGHT_GRAD, OVERLAP = "F", "B", "I", "W", "O"


class Action(Protocol):
    """What the rules read of an action (:class:`commlab.pipeline.schedule.actions.Action`, which
    checks its kind against this module's registry, so this module cannot import it)."""

    stage: int
    kind: str
    microbatch: int

    def at(self, stage: int, kind: str) -> Action: ...


@dataclass(frozen=True)
class Kind:
    """One action kind.

    ``needs(action, stages, split)``: the actions whose results it consumes (at most one on
    another stage: the message it receives). ``split``: True if the kind runs only on stages whose
    backward is split (I, W), False only on the others (B), None on any. ``stash``: +1 if it
    leaves the micro-batch's activations alive on its stage, -1 if it frees them, 0 neither.
    ``ticks``: its length on the schedule's own clock (:mod:`commlab.pipeline.schedule.clock`).
    ``seconds(forward, backward, weight_share)``: its compute time from a stage's forward and
    backward times. ``recomputes``: a checkpointed micro-batch's forward is re-run before it.
    ``composite``: the action is its ``parts`` run in order (``O``); readers expand it first.
    """

    name: str
    needs: Callable[[Action, int, frozenset[int]], tuple[Action, ...]]
    seconds: Callable[[float, float, float], float]
    split: bool | None = None
    stash: int = 0
    ticks: int = 1
    recomputes: bool = False
    composite: bool = False
    doc: str = ""


KINDS: dict[str, Kind] = {}


def register_kind(kind: Kind) -> Kind:
    """Add an action kind (a single capital letter other than those taken)."""
    if len(kind.name) != 1 or not kind.name.isupper():
        raise ValueError(f"an action kind is one capital letter, got {kind.name!r}")
    KINDS[kind.name] = kind
    return kind


def gradient_of(stage: int, split: frozenset[int]) -> str:
    """The kind that computes ``stage``'s input gradient: I if its backward is split, else B."""
    return INPUT_GRAD if stage in split else BACKWARD


def _forward_needs(a: Action, stages: int, split: frozenset[int]) -> tuple[Action, ...]:
    return (a.at(a.stage - 1, FORWARD),) if a.stage > 0 else ()


def _backward_needs(a: Action, stages: int, split: frozenset[int]) -> tuple[Action, ...]:
    # Its own forward, and the input gradient of stage s+1 (its B or its I).
    later = (a.at(a.stage + 1, gradient_of(a.stage + 1, split)),) if a.stage + 1 < stages else ()
    return (a.at(a.stage, FORWARD), *later)


def _weight_needs(a: Action, stages: int, split: frozenset[int]) -> tuple[Action, ...]:
    return (a.at(a.stage, INPUT_GRAD),)  # I leaves the weights' gradients to compute


register_kind(Kind(FORWARD, _forward_needs, lambda f, b, w: f, stash=+1, doc="forward"))
register_kind(Kind(BACKWARD, _backward_needs, lambda f, b, w: b, split=False, stash=-1, ticks=2, recomputes=True,
                   doc="full backward"))  # fmt: skip
register_kind(Kind(INPUT_GRAD, _backward_needs, lambda f, b, w: b * (1.0 - w), split=True, recomputes=True,
                   doc="input gradient (zero bubble)"))  # fmt: skip
register_kind(Kind(WEIGHT_GRAD, _weight_needs, lambda f, b, w: b * w, split=True, stash=-1,
                   doc="weight gradient (zero bubble)"))  # fmt: skip


def parts(action: Action) -> tuple[Action, ...]:
    """The simple actions ``action`` runs, in order: its ``parts`` if its kind is composite, else itself."""
    return tuple(getattr(action, "parts", ())) or (action,)


def _overlap_needs(a: Action, stages: int, split: frozenset[int]) -> tuple[Action, ...]:
    # What the parts need from outside the pair: the forward's input and the backward's gradient.
    inner = parts(a)
    return tuple(d for p in inner for d in dependencies(p, stages, split) if d not in inner)


# torch's OVERLAP_F_B: run as the forward, its sends posted, then the backward (comm.lower_comm), so
# the forward's message travels while the backward computes (DeepSeek-V3 report, section 3.2.1).
register_kind(Kind(OVERLAP, _overlap_needs, lambda f, b, w: f + b, ticks=3, composite=True,
                   doc="forward of one stage overlapped with the full backward of another (DualPipeV)"))  # fmt: skip


def runs_on(kind: str, stage: int, split: frozenset[int]) -> bool:
    """Whether ``kind`` is one of the kinds ``stage`` runs (B or I/W, by ``split``)."""
    if KINDS[kind].composite:
        return False  # a pair's parts are the ones that run on a stage
    wanted = KINDS[kind].split
    return wanted is None or wanted == (stage in split)


def dependencies(action: Action, stages: int, split: frozenset[int] = frozenset()) -> tuple[Action, ...]:
    """The actions whose results ``action`` consumes (``split``: stages that run I/W, not B).

    F(s, i) needs F(s-1, i); B(s, i) and I(s, i) need F(s, i) and the input gradient of stage s+1
    (its B or its I); W(s, i) needs I(s, i). The one dependency rule: every reader asks here.
    """
    return KINDS[action.kind].needs(action, stages, split)


def producer(action: Action, stages: int, split: frozenset[int]) -> Action | None:
    """The action on another stage whose message ``action`` consumes, or None if it needs none."""
    return next((d for d in dependencies(action, stages, split) if d.stage != action.stage), None)


def consumer(action: Action, stages: int, split: frozenset[int]) -> Action | None:
    """The action on a neighbouring stage that consumes what ``action`` produces (the inverse of
    :func:`producer`), or None if it sends nothing."""
    for stage in (action.stage + 1, action.stage - 1):
        if 0 <= stage < stages:
            for kind in KINDS:
                if runs_on(kind, stage, split) and producer(c := action.at(stage, kind), stages, split) == action:
                    return c
    return None


def split_stages(actions) -> frozenset[int]:
    """Stages whose backward is split into I and W (their input gradient comes from I, not B)."""
    return frozenset(p.stage for rank in actions for a in rank for p in parts(a) if p.kind == INPUT_GRAD)
