"""Pipeline schedules as data: each rank's ordered list of forward and backward actions.

A schedule is a pure function of the number of ranks ``p``, micro-batches ``m`` and (for the
interleaved schedule) virtual stages per rank ``v``. It returns one tuple of :class:`Action` per
rank; nothing here touches a process group, so every schedule is tested as literal lists.

Stage ``s`` of ``p * v`` lives on rank ``s % p`` (Megatron-LM's "looping" placement; with
``v = 1`` stage s is simply rank s). An action names a stage, not a rank, so the executor and the
simulator both find the rank holding a stage with :func:`stage_rank`.
"""

from __future__ import annotations

from dataclasses import dataclass

FORWARD = "F"
BACKWARD = "B"
SCHEDULES = ("gpipe", "1f1b", "interleaved")

Actions = tuple[tuple["Action", ...], ...]  # indexed by rank


@dataclass(frozen=True, order=True)
class Action:
    """One unit of work: run ``stage``'s forward or backward on micro-batch ``microbatch``."""

    stage: int
    kind: str  # FORWARD or BACKWARD
    microbatch: int

    def __post_init__(self) -> None:
        if self.kind not in (FORWARD, BACKWARD):
            raise ValueError(f"action kind must be 'F' or 'B', got {self.kind!r}")

    def __str__(self) -> str:
        # The compact form torch.distributed.pipelining prints: stage, kind, micro-batch ("1F0").
        return f"{self.stage}{self.kind}{self.microbatch}"

    @classmethod
    def parse(cls, text: str) -> Action:
        for kind in (FORWARD, BACKWARD):
            stage, sep, mb = text.partition(kind)
            if sep and stage.isdigit() and mb.isdigit():
                return cls(int(stage), kind, int(mb))
        raise ValueError(f"cannot parse action {text!r}: expected e.g. '1F0' or '0B3'")


def stage_rank(stage: int, ranks: int) -> int:
    """The rank that holds ``stage`` under the looping placement."""
    return stage % ranks


def num_stages(actions: Actions) -> int:
    return 1 + max(a.stage for rank in actions for a in rank)


def _check(ranks: int, microbatches: int, virtual: int) -> None:
    if ranks < 1:
        raise ValueError(f"a pipeline needs at least one rank, got {ranks}")
    if microbatches < 1:
        raise ValueError(f"a pipeline needs at least one micro-batch, got {microbatches}")
    if virtual < 1:
        raise ValueError(f"virtual stages per rank must be >= 1, got {virtual}")


def gpipe(ranks: int, microbatches: int) -> Actions:
    """Fill-drain (GPipe, Huang et al. 2019): every forward, then every backward.

    Backwards run in micro-batch order, as torch's ScheduleGPipe does; all ``m`` micro-batches'
    activations are alive on every stage at the turn, which is GPipe's memory cost.
    """
    _check(ranks, microbatches, 1)
    return tuple(
        tuple(Action(r, FORWARD, i) for i in range(microbatches))
        + tuple(Action(r, BACKWARD, i) for i in range(microbatches))
        for r in range(ranks)
    )


def one_f_one_b(ranks: int, microbatches: int) -> Actions:
    """PipeDream-Flush / 1F1B (Narayanan et al. 2021) in three named phases.

    Rank r runs ``p - r - 1`` warm-up forwards, then alternates one forward and one backward
    (steady state), then drains the remaining backwards (cool-down). At most ``p - r`` micro-batches
    are in flight on rank r instead of GPipe's ``m``; the bubble is the same.
    """
    _check(ranks, microbatches, 1)
    return tuple(_one_f_one_b_rank(r, ranks, microbatches) for r in range(ranks))


def _one_f_one_b_rank(r: int, p: int, m: int) -> tuple[Action, ...]:
    warmup = min(p - r - 1, m)
    warm = [Action(r, FORWARD, i) for i in range(warmup)]
    steady: list[Action] = []
    for i in range(m - warmup):
        steady += [Action(r, FORWARD, warmup + i), Action(r, BACKWARD, i)]
    cool = [Action(r, BACKWARD, i) for i in range(m - warmup, m)]
    return tuple(warm + steady + cool)


def interleaved(ranks: int, microbatches: int, virtual: int = 2) -> Actions:
    """Interleaved 1F1B (Megatron-LM, Narayanan et al. SC'21, section 2.2).

    Each rank holds ``v`` stages (chunks) ``r, r + p, r + 2p, ...``. Micro-batches go through the
    chunks in groups of ``p``: forward k of a rank is micro-batch ``(k // (p*v)) * p + k % p`` on
    chunk ``(k // p) % v``; backwards visit the chunks in reverse. Warm-up is
    ``2 (p - r - 1) + (v - 1) p`` forwards, as in Megatron's ``forward_backward_pipelining_with_
    interleaving``, so that each rank's first backward finds its gradient already on the way. The
    bubble shrinks by a factor v; ``m`` must be a multiple of ``p`` (Megatron's condition).
    """
    _check(ranks, microbatches, virtual)
    if microbatches % ranks:
        raise ValueError(
            f"the interleaved schedule needs micro-batches to be a multiple of the ranks: "
            f"{microbatches} micro-batches, {ranks} ranks"
        )
    return tuple(_interleaved_rank(r, ranks, microbatches, virtual) for r in range(ranks))


def _interleaved_rank(r: int, p: int, m: int, v: int) -> tuple[Action, ...]:
    total = m * v

    def mb(k: int) -> int:
        return (k // (p * v)) * p + k % p

    def fwd(k: int) -> Action:
        return Action(((k // p) % v) * p + r, FORWARD, mb(k))

    def bwd(k: int) -> Action:
        return Action((v - 1 - (k // p) % v) * p + r, BACKWARD, mb(k))

    warmup = min(2 * (p - r - 1) + (v - 1) * p, total)
    warm = [fwd(k) for k in range(warmup)]
    steady: list[Action] = []
    for i in range(total - warmup):
        steady += [fwd(warmup + i), bwd(i)]
    cool = [bwd(k) for k in range(total - warmup, total)]
    return tuple(warm + steady + cool)


def build(name: str, ranks: int, microbatches: int, virtual: int = 1) -> Actions:
    """The named schedule; ``virtual`` is used (and must be > 1 to matter) by ``interleaved`` only."""
    if name == "gpipe":
        return gpipe(ranks, microbatches)
    if name == "1f1b":
        return one_f_one_b(ranks, microbatches)
    if name == "interleaved":
        return interleaved(ranks, microbatches, virtual)
    raise ValueError(f"unknown schedule {name!r}: choose from {', '.join(SCHEDULES)}")


def format_actions(actions: Actions) -> list[str]:
    """One line per rank, actions in their compact form: ``["0F0 0F1 0B0 0B1", ...]``."""
    return [" ".join(str(a) for a in rank) for rank in actions]
