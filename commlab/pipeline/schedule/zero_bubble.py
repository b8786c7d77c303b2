"""Zero-bubble schedules (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024).

The backward of a stage is split in two: ``I`` computes the gradient of the stage's input, which
the previous stage waits for, and ``W`` the gradient of its weights, which nobody waits for. Moving
W out of the critical path lets the gradient travel back through the pipeline at the speed of I,
and W fills the bubbles that remain.

``zb_h1``: one stage per rank. Same warm-up as 1F1B; in steady state rank r runs F, I and the W
of the micro-batch r places earlier, so at most p micro-batches are alive on any rank (1F1B's peak
on rank 0: "ZB-H1 ... the same peak memory as 1F1B", section 3.1). The deferred W's run in the
cool-down, where 1F1B's ranks idle waiting for gradients. Bubble about (p-1)(F+I-W) instead of
(p-1)(F+I+W).

``deferred_weights``: any order's backward split into I then W, rank r holding back r weight
gradients as ZB-H1 does; applied to interleaved 1F1B it is the ``interleaved-zb`` schedule (the
interleaved zero-bubble family of torch's ScheduleInterleavedZeroBubble, not its exact order).

``dualpipev``: DeepSeek-V3's DualPipe folded onto the V placement (DeepSeek-AI, "DeepSeek-V3
Technical Report", 2024, section 3.2.1; torch's ScheduleDualPipeV), in eight phases per rank
(:func:`dualpipev`). Its steady state pairs the forward of one micro-batch on one of the rank's
stages with the full backward of another on the other stage: one ``O`` action (torch's
OVERLAP_F_B), emitted where torch's ScheduleDualPipeV emits one.

``zb_v``: two stages per rank in the V placement [0, 1, ..., p-1, p-1, ..., 0] (section 6), built
by a greedy list scheduler on equal-time actions in which a message between ranks takes one
action to arrive: a free rank runs a ready I first (it unblocks a peer), then a ready F (the
later stage first; on the first half of the V only while the rank holds fewer than 2p
stage-activations, 1F1B's peak), then the oldest ready W. Building with the message time in makes
the list fill it with other work instead of counting on free messages (see ``LATENCY``). Then
each W is pulled next to its own I wherever the simulated step does not grow, since the executor
runs such a pair as one cheaper backward (:func:`commlab.pipeline.schedule.fuse.pull_weights`).
"""

from __future__ import annotations

from functools import lru_cache

from commlab.pipeline.schedule.actions import BACKWARD, FORWARD, INPUT_GRAD, WEIGHT_GRAD, Action, Actions, overlap, v_shape
from commlab.pipeline.schedule.fuse import pull_weights
from commlab.pipeline.schedule.kinds import dependencies


def zb_h1(ranks: int, microbatches: int) -> Actions:
    """ZB-H1: 1F1B with the backward split into I and W, rank r's W held back by r micro-batches."""
    return tuple(_zb_h1_rank(r, ranks, microbatches) for r in range(ranks))


def _zb_h1_rank(r: int, p: int, m: int) -> tuple[Action, ...]:
    warmup = min(p - r - 1, m)
    out = [Action(r, FORWARD, i) for i in range(warmup)]
    done_w = 0
    for k in range(m):
        if warmup + k < m:
            out.append(Action(r, FORWARD, warmup + k))
        out.append(Action(r, INPUT_GRAD, k))
        # Keep r weight gradients pending: they fill the cool-down, when gradients come slowly.
        if k - done_w >= r:
            out.append(Action(r, WEIGHT_GRAD, done_w))
            done_w += 1
    out += [Action(r, WEIGHT_GRAD, i) for i in range(done_w, m)]
    return tuple(out)


def deferred_weights(actions: Actions) -> Actions:
    """Each B split into I, and its W run after rank r's next r input gradients (the rest at the
    end). A W needs only its own I, on its own rank, so any valid order stays valid."""
    out = []
    for r, rank in enumerate(actions):
        lst: list[Action] = []
        pending: list[Action] = []
        for a in rank:
            if a.kind != BACKWARD:
                lst.append(a)
                continue
            lst.append(a.at(a.stage, INPUT_GRAD))
            pending.append(a.at(a.stage, WEIGHT_GRAD))
            if len(pending) > r:
                lst.append(pending.pop(0))
        out.append(tuple(lst + pending))
    return tuple(out)


def dualpipev(ranks: int, microbatches: int) -> Actions:
    """DualPipeV's order (module docstring); m >= 2p. Every stage runs I and W: where DualPipeV
    runs a full backward, the list has its I then at once its W, the same computation."""
    p, m = ranks, microbatches
    if m < 2 * p:
        raise ValueError(f"schedule 'dualpipev' needs at least as many micro-batches as stages: "
                         f"{m} micro-batches, {2 * p} stages")  # fmt: skip
    return tuple(_dualpipev_rank(r, p, m) for r in range(p))


def _dualpipev_rank(r: int, p: int, m: int) -> tuple[Action, ...]:
    down, up = r, 2 * p - 1 - r  # the rank's stage on the way down the V, and on the way up
    out: list[Action] = []
    fwd, bwd = {down: 0, up: 0}, {down: 0, up: 0}  # next micro-batch per stage
    weights: list[Action] = []  # W's held back after a split backward's I, run where there is room

    def forward(stage: int) -> None:
        out.append(Action(stage, FORWARD, fwd[stage]))
        fwd[stage] += 1

    def grad(stage: int, split: bool) -> None:  # split: W held back; else a full backward, I then W
        out.append(Action(stage, INPUT_GRAD, bwd[stage]))
        (weights if split else out).append(Action(stage, WEIGHT_GRAD, bwd[stage]))
        bwd[stage] += 1

    def weight() -> None:
        if weights:
            out.append(weights.pop(0))

    def pair(forward_stage: int, backward_stage: int) -> None:  # F of one stage overlapped with B of the other
        out.append(overlap(Action(forward_stage, FORWARD, fwd[forward_stage]), backward_stage, bwd[backward_stage]))
        fwd[forward_stage] += 1
        bwd[backward_stage] += 1

    for _ in range(2 * (p - r - 1)):  # 1. forwards down the V fill the pipeline
        forward(down)
    for _ in range(r + 1):  # 2. both stages' forwards
        forward(down)
        forward(up)
    for _ in range(p - r - 1):  # 3. zero-bubble steps on the way up: I, a held-back W, F
        grad(up, True)
        weight()
        forward(up)
    for k in range(m - 2 * p + r + 1):  # 4. steady state: (F down, B up), then (F up, B down)
        if k == 0 and r == p - 1:  # torch does not pair these two: a smaller bubble
            forward(down)
            grad(up, False)
        else:
            pair(down, up)
        pair(up, down)
    for _ in range(p - r - 1):  # 5. B up, then (F up, B down)
        grad(up, False)
        pair(up, down)
    split = False
    for k in range(r + 1):  # 6. the last backwards; the second half of them split into I and W
        split = split or (k == (r + 1) // 2 and r % 2 == 1)
        grad(up, split)
        split = split or (k == (r + 1) // 2 and r % 2 == 0)
        grad(down, split)
    for _ in range(p - r - 1):  # 7. a held-back W, then B down
        weight()
        grad(down, split)
    while weights:  # 8. the remaining W's
        weight()
    return tuple(out)


# The greedy scheduler's clock: every action takes TICKS ticks (F = I = W, the paper's unit
# assumption) and a message between ranks takes LATENCY more before its consumer may start. With
# LATENCY = 0 the list is best only when messages are free: simulated with messages of 0.3 of an
# action it ended 8.4 actions (9%) behind torch's ScheduleZBVZeroBubble order at p = 2, m = 16,
# and measured 1.13x torch's step at m = 16. One action of slack lets a rank fill the message
# time with another ready action: 0.4 actions behind torch's order there in simulation, one
# action behind when messages are free. Measured at world 2 against torch, m = 4/8/16, 40-80
# steps each (commlab pipeline bench --schedules zb-v -m 4,8,16 --width 512): LATENCY 0
# 0.96/1.03/1.13, 1 1.08/1.01/1.03, 2 0.99/0.99/0.97.
TICKS, LATENCY = 2, 2


@lru_cache(maxsize=64)  # pure, and the W pass simulates the list once per I (seconds at p = 4, m = 16)
def zb_v(ranks: int, microbatches: int) -> Actions:
    """ZB-V: 2p stages in the V placement, ordered by the greedy list scheduler, W's then pulled
    next to their I where that costs nothing (module docstring)."""
    return pull_weights(_greedy_zb_v(ranks, microbatches))


def _greedy_zb_v(ranks: int, microbatches: int) -> Actions:
    p, m = ranks, microbatches
    placement = v_shape(p)
    stages = 2 * p
    local = [[s for s in range(stages) if placement[s] == r] for r in range(p)]
    nxt = {(s, k): 0 for s in range(stages) for k in (FORWARD, INPUT_GRAD, WEIGHT_GRAD)}  # next micro-batch
    end: dict[tuple[int, str, int], int] = {}
    held, free = [0] * p, [0] * p  # stage activations alive; tick at which each rank is free
    out: list[list[Action]] = [[] for _ in range(p)]
    t, total = 0, 3 * stages * m
    while sum(map(len, out)) < total:
        for r in range(p):
            if free[r] > t:
                continue

            def ready(key, r=r) -> bool:  # done, and arrived if it was computed on another rank
                return key in end and end[key] + (0 if placement[key[0]] == r else LATENCY) <= t

            pick = _pick(local[r], nxt, ready, stages, m, held[r] < 2 * p)
            if pick is None:
                continue
            s, kind, i = pick
            out[r].append(Action(s, kind, i))
            nxt[(s, kind)] += 1
            end[pick] = free[r] = t + TICKS
            held[r] += {FORWARD: 1, INPUT_GRAD: 0, WEIGHT_GRAD: -1}[kind]
        t += 1
        if t > 4 * (TICKS + LATENCY) * total:  # cannot happen for a correct scheduler; guards the loop
            raise RuntimeError("zb_v: the greedy scheduler made no progress")
    return tuple(tuple(r) for r in out)


def _pick(stages_here, nxt, ready, stages, m, room):
    candidates = {FORWARD: [], INPUT_GRAD: [], WEIGHT_GRAD: []}
    split = frozenset(range(stages))  # every stage of the V runs I and W
    for s in stages_here:
        for kind, found in candidates.items():
            i = nxt[(s, kind)]
            if i < m and all(ready((d.stage, d.kind, d.microbatch)) for d in dependencies(Action(s, kind, i), stages, split)):
                if kind != FORWARD or room or s >= stages // 2:
                    found.append((s, kind, i))
    if candidates[INPUT_GRAD]:
        return min(candidates[INPUT_GRAD], key=lambda c: (c[2], -c[0]))
    if candidates[FORWARD]:
        return max(candidates[FORWARD], key=lambda c: (c[0], -c[2]))
    if candidates[WEIGHT_GRAD]:
        return min(candidates[WEIGHT_GRAD], key=lambda c: (c[2], c[0]))
    return None
