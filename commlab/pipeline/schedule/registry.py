"""Pipeline schedules as data, and the registry that names them.

A schedule is a pure function of the number of ranks ``p``, micro-batches ``m`` and virtual
stages per rank ``v``. It returns one tuple of :class:`Action` per rank; nothing here touches a
process group, so every schedule is tested as literal lists. :data:`REGISTRY` is the one place a
schedule is declared (:class:`ScheduleSpec`: builder, placement, action kinds, what it accepts);
the executor, the CLI, the validator and the benchmark all read it.

gpipe, 1f1b, interleaved and looped-bfs use the looping placement (stage s on rank s % p); the
zero-bubble schedules (zb-h1, zb-v, interleaved-zb, dualpipev) are in
:mod:`commlab.pipeline.schedule.zero_bubble`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from commlab.pipeline.schedule.actions import (
    BACKWARD,
    FORWARD,
    INPUT_GRAD,
    OVERLAP,
    WEIGHT_GRAD,
    Action,
    Actions,
    format_actions,
    looping,
    num_stages,
    v_shape,
)
from commlab.pipeline.schedule.zero_bubble import deferred_weights, dualpipev, zb_h1, zb_v

__all__ = ["Action", "Actions", "REGISTRY", "ScheduleSpec", "build", "format_actions", "num_stages", "register"]


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
            f"schedule 'interleaved' needs micro-batches to be a multiple of the ranks: "
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


def looped_bfs(ranks: int, microbatches: int, virtual: int = 2) -> Actions:
    """Looped breadth-first (Lamy-Poirier, "Breadth-First Pipeline Parallelism", 2023; torch's
    ScheduleLoopedBFS): each rank runs every micro-batch's forward through its first stage, then
    its next stage, ...; then the backwards, last stage first, micro-batches in reverse order (as
    torch does). Looping placement; all m micro-batches stay alive on every stage, as in GPipe."""
    _check(ranks, microbatches, virtual)
    return tuple(_looped_bfs_rank(r, ranks, microbatches, virtual) for r in range(ranks))


def _looped_bfs_rank(r: int, p: int, m: int, v: int) -> tuple[Action, ...]:
    stages = [k * p + r for k in range(v)]
    forward = [Action(s, FORWARD, i) for s in stages for i in range(m)]
    return tuple(forward + [Action(s, BACKWARD, i) for s in reversed(stages) for i in reversed(range(m))])


@dataclass(frozen=True)
class ScheduleSpec:
    """A registered schedule: everything the executor, CLI, validator and benchmark need to know.

    ``build(ranks, microbatches, virtual)`` returns the actions; ``placement(ranks, stages)`` the
    rank of each stage; ``kinds`` the action kinds it uses; ``virtual`` the stages per rank it
    accepts (None: any); ``multiple``: micro-batches must be a multiple of the ranks; ``fill``: at
    least as many micro-batches as stages; ``torch``:
    the torch.distributed.pipelining class running the same order (for the benchmark), or None.
    """

    name: str
    build: Callable[[int, int, int], Actions]
    placement: Callable[[int, int], tuple[int, ...]] = looping
    kinds: frozenset[str] = frozenset({FORWARD, BACKWARD})
    virtual: tuple[int, ...] | None = (1,)
    multiple: bool = False
    fill: bool = False
    torch: str | None = None
    doc: str = ""

    def check(self, ranks: int, microbatches: int, virtual: int) -> None:
        """ValueError naming what this schedule does not accept."""
        _check(ranks, microbatches, virtual)
        if self.virtual is not None and virtual not in self.virtual:
            allowed = " or ".join(map(str, self.virtual))
            raise ValueError(f"schedule {self.name!r} runs {allowed} stage(s) per rank, not {virtual} "
                             f"({ranks * virtual} stages on {ranks} ranks)")  # fmt: skip
        if self.multiple and microbatches % ranks:
            raise ValueError(f"schedule {self.name!r} needs micro-batches to be a multiple of the ranks: "
                             f"{microbatches} micro-batches, {ranks} ranks")  # fmt: skip
        if self.fill and microbatches < ranks * virtual:
            raise ValueError(f"schedule {self.name!r} needs at least as many micro-batches as stages: "
                             f"{microbatches} micro-batches, {ranks * virtual} stages")  # fmt: skip


REGISTRY: dict[str, ScheduleSpec] = {}


def register(spec: ScheduleSpec) -> ScheduleSpec:
    """Add a schedule: the one place a new schedule is declared."""
    REGISTRY[spec.name] = spec
    return spec


register(ScheduleSpec("gpipe", lambda p, m, v: gpipe(p, m), torch="ScheduleGPipe", doc="fill-drain"))
register(ScheduleSpec("1f1b", lambda p, m, v: one_f_one_b(p, m), torch="Schedule1F1B", doc="PipeDream-Flush"))
register(ScheduleSpec("interleaved", interleaved, virtual=None, multiple=True, torch="ScheduleInterleaved1F1B",
                      doc="Megatron interleaved 1F1B, looping placement"))  # fmt: skip
register(ScheduleSpec("zb-h1", lambda p, m, v: zb_h1(p, m), kinds=frozenset({FORWARD, INPUT_GRAD, WEIGHT_GRAD}),
                      doc="zero bubble H1, 1F1B memory"))  # fmt: skip
register(ScheduleSpec("zb-v", lambda p, m, v: zb_v(p, m), placement=lambda p, s: v_shape(p, s), virtual=(2,),
                      kinds=frozenset({FORWARD, INPUT_GRAD, WEIGHT_GRAD}), torch="ScheduleZBVZeroBubble",
                      doc="zero bubble V, two stages per rank"))  # fmt: skip
register(ScheduleSpec("looped-bfs", looped_bfs, virtual=None, torch="ScheduleLoopedBFS",
                      doc="looped breadth-first, looping placement"))  # fmt: skip
register(ScheduleSpec("interleaved-zb", lambda p, m, v: deferred_weights(interleaved(p, m, v)), virtual=None,
                      multiple=True, kinds=frozenset({FORWARD, INPUT_GRAD, WEIGHT_GRAD}),
                      doc="interleaved 1F1B, backward split, weights deferred"))  # fmt: skip
register(ScheduleSpec("dualpipev", lambda p, m, v: dualpipev(p, m), placement=lambda p, s: v_shape(p, s), virtual=(2,),
                      fill=True, kinds=frozenset({FORWARD, INPUT_GRAD, WEIGHT_GRAD, OVERLAP}), torch="ScheduleDualPipeV",
                      doc="DualPipe on the V placement, m >= 2p"))  # fmt: skip
SCHEDULES = tuple(REGISTRY)  # the built-in names; REGISTRY also holds any registered later


def spec(name: str) -> ScheduleSpec:
    if name not in REGISTRY:
        raise ValueError(f"unknown schedule {name!r}: choose from {', '.join(REGISTRY)}")
    return REGISTRY[name]


def build(name: str, ranks: int, microbatches: int, virtual: int = 1) -> Actions:
    """The named schedule's actions, after checking the schedule accepts this shape."""
    found = spec(name)
    found.check(ranks, microbatches, virtual)
    return found.build(ranks, microbatches, virtual)
