"""Actions and placements: the data a schedule is made of, and its CSV form.

An :class:`Action` names a stage, a kind and a micro-batch. The kinds (``F`` forward, ``B`` full
backward, the zero-bubble ``I`` and ``W``, and the composite ``O`` whose ``parts`` are a forward
and another stage's full backward, torch's OVERLAP_F_B, written "0F2+3B0") and what each needs
are in :mod:`commlab.pipeline.schedule.kinds`; :func:`flatten` expands the composite ones.

A placement lists the rank of each stage. The looping placement (stage s on rank s % p) is
Megatron-LM's and torch's default; the V placement [0, 1, ..., p-1, p-1, ..., 0] puts the first
and last stages on rank 0, which ZB-V needs.
"""

from __future__ import annotations

import csv
import io
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from commlab.pipeline.schedule.kinds import BACKWARD, FORWARD, INPUT_GRAD, KINDS, OVERLAP, WEIGHT_GRAD, parts

__all__ = ["BACKWARD", "FORWARD", "INPUT_GRAD", "KINDS", "OVERLAP", "WEIGHT_GRAD", "Action", "Actions", "as_actions", "flatten", "overlap"]

_PATTERN = re.compile(r"^(\d+)([A-Z])(\d+)$")
# Non-compute entries torch writes into its compute-only orders; they carry no work here (commlab
# reduces gradients in DataParallelStage and keeps parameters unsharded).
_TORCH_NO_OPS = ("REDUCE_GRAD", "UNSHARD", "RESHARD")

Actions = tuple[tuple["Action", ...], ...]  # indexed by rank


@dataclass(frozen=True, order=True)
class Action:
    """One unit of work: run ``stage``'s ``kind`` (F, B, I or W) on micro-batch ``microbatch``.

    An ``O`` action (:func:`overlap`) carries its ``parts`` (F, I, W); its stage and micro-batch
    are its forward's."""

    stage: int
    kind: str
    microbatch: int
    parts: tuple[Action, ...] = ()

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"action kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if self.stage < 0 or self.microbatch < 0:
            raise ValueError(f"stage and micro-batch must be >= 0, got {self.stage}, {self.microbatch}")
        if KINDS[self.kind].composite != bool(self.parts):
            raise ValueError(f"only a composite kind has parts: {self.kind!r} with {len(self.parts)} parts")
        if self.kind == OVERLAP:
            f, i, w = self.parts
            if (f.stage, f.kind, f.microbatch) != (self.stage, FORWARD, self.microbatch) or i.kind != INPUT_GRAD \
                    or w != i.at(i.stage, WEIGHT_GRAD) or i.stage == f.stage:  # fmt: skip
                raise ValueError(f"an overlap is a forward and another stage's I then W, got {self.parts}")

    def __str__(self) -> str:
        # The compact form torch.distributed.pipelining prints: stage, kind, micro-batch ("1F0");
        # an overlap as its forward and its full backward ("0F2+3B0").
        if self.kind == OVERLAP:
            return f"{self.parts[0]}+{self.parts[1].stage}{BACKWARD}{self.parts[1].microbatch}"
        return f"{self.stage}{self.kind}{self.microbatch}"

    def at(self, stage: int, kind: str) -> Action:
        """The action of ``kind`` on ``stage`` for the same micro-batch."""
        return Action(stage, kind, self.microbatch)

    @classmethod
    def parse(cls, text: str) -> Action:
        if "+" in text:
            f, b = (cls.parse(t) for t in text.split("+", 1))
            if f.kind != FORWARD or b.kind != BACKWARD:
                raise ValueError(f"cannot parse overlap {text!r}: expected a forward + a full backward, e.g. '0F2+3B0'")
            return overlap(f, b.stage, b.microbatch)
        found = _PATTERN.match(text.strip())
        if not found or found[2] not in KINDS:
            raise ValueError(f"cannot parse action {text!r}: expected e.g. '1F0', '0B3', '2I1' or '2W1' (kinds: {', '.join(KINDS)})")
        return cls(int(found[1]), found[2], int(found[3]))


def overlap(forward: Action, stage: int, microbatch: int) -> Action:
    """The ``O`` action: ``forward`` overlapped with ``stage``'s full backward of ``microbatch``."""
    backward = Action(stage, INPUT_GRAD, microbatch)
    return Action(forward.stage, OVERLAP, forward.microbatch, (forward, backward, backward.at(stage, WEIGHT_GRAD)))


def flatten(actions: Actions) -> Actions:
    """Every composite action replaced by its parts, in order (what runs)."""
    return tuple(tuple(p for a in rank for p in parts(a)) for rank in actions)


def as_actions(lists: Sequence[Iterable[Action | str]]) -> Actions:
    """Per-rank lists of :class:`Action` or their strings ("0F1") as a schedule."""
    if isinstance(lists, str) or not isinstance(lists, Sequence):
        raise ValueError("a schedule is a registered name or one list of actions per rank")
    out = []
    for r, rank in enumerate(lists):
        if isinstance(rank, str):
            raise ValueError(f"rank {r}: expected a list of actions, got the string {rank!r}")
        out.append(tuple(a if isinstance(a, Action) else Action.parse(str(a)) for a in rank))
    return tuple(out)


def num_stages(actions: Actions) -> int:
    return 1 + max((p.stage for rank in actions for a in rank for p in parts(a)), default=-1)


def num_microbatches(actions: Actions) -> int:
    return 1 + max((p.microbatch for rank in actions for a in rank for p in parts(a)), default=-1)


def looping(ranks: int, stages: int) -> tuple[int, ...]:
    """Stage s on rank s % p (Megatron-LM's interleaved placement; s itself when stages == ranks)."""
    return tuple(s % ranks for s in range(stages))


def v_shape(ranks: int, stages: int | None = None) -> tuple[int, ...]:
    """[0, 1, ..., p-1, p-1, ..., 0]: two stages per rank, the first and last on rank 0 (ZB-V)."""
    if stages is not None and stages != 2 * ranks:
        raise ValueError(f"the V placement has two stages per rank: {2 * ranks} stages for {ranks} ranks, not {stages}")
    return tuple(range(ranks)) + tuple(reversed(range(ranks)))


def placement_of(actions: Actions) -> tuple[int, ...]:
    """The placement a schedule implies: the rank that runs each stage's first action."""
    found: dict[int, int] = {}
    for r, rank in enumerate(actions):
        for a in rank:
            for p in parts(a):
                found.setdefault(p.stage, r)
    return tuple(found.get(s, -1) for s in range(num_stages(actions)))


def check_placement(placement: Sequence[int], ranks: int, stages: int) -> tuple[int, ...]:
    """``placement`` as a tuple; ValueError unless it maps every stage to a rank and uses every rank."""
    placement = tuple(int(r) for r in placement)
    if len(placement) != stages:
        raise ValueError(f"placement {list(placement)} lists {len(placement)} stages, the model has {stages}")
    bad = [r for r in placement if not 0 <= r < ranks]
    if bad:
        raise ValueError(f"placement {list(placement)} names ranks {bad} outside 0..{ranks - 1}")
    idle = sorted(set(range(ranks)) - set(placement))
    if idle:
        raise ValueError(f"placement {list(placement)} gives no stage to ranks {idle}")
    return placement


def format_actions(actions: Sequence[Sequence[object]]) -> list[str]:
    """One line per rank, actions in their compact form: ``["0F0 0F1 0B0 0B1", ...]`` (a comm op
    as ``SEND(0F0>1F0)``, ``WAIT(RECV 1B0>0B0)``)."""
    def text(op) -> str:
        return str(op) if isinstance(op, Action) else f"{op.kind}({str(op).split(' ', 1)[1]})"

    return [" ".join(text(a) for a in rank) for rank in actions]


def to_csv(actions: Actions) -> str:
    """torch.distributed.pipelining's compute-only CSV: one row per rank, one action per cell."""
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    for rank in actions:
        writer.writerow([str(a) for a in rank])
    return out.getvalue()


def from_csv(text: str) -> Actions:
    """Read a compute-only CSV as written by torch's ``_dump_csv`` (``PipelineScheduleMulti``).

    Empty cells are torch's idle steps (None) and are dropped: here a rank simply waits for its
    next action's input. ``REDUCE_GRAD``/``UNSHARD``/``RESHARD`` carry no work in commlab and are
    dropped too; communication actions (``SEND_F``...) mean the compute+comms format, refused.
    """
    rows = []
    for r, row in enumerate(csv.reader(io.StringIO(text))):
        cells = [c.strip() for c in row if c.strip() and not any(c.strip().endswith(n) for n in _TORCH_NO_OPS)]
        comms = [c for c in cells if "SEND" in c or "RECV" in c]
        if comms:
            raise ValueError(f"rank {r}: {comms[0]!r} is a communication action; only the compute-only format is read")
        rows.append(tuple(Action.parse(c) for c in cells))
    return tuple(rows)
