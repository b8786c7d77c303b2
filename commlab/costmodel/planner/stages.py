"""The planner's per-stage profile: every candidate stage timed whole, as the executor runs it.

A per-layer profile times each layer alone, again and again, so its weights and its ``.grad``
stay in cache; the executor runs a stage's layers in a row, between other micro-batches' actions,
and its split backward walks all of them twice (I, then W: :mod:`commlab.pipeline.runtime.compute`).
Summed per-layer I and W came out 1.4-1.5x short of the executor's on the 10 x 640 MLP
(docs/measurements.md), while F and B matched within 10-20%. So the planner times each stage
a plan can have (the layer ranges its :func:`~commlab.pipeline.runtime.partition.partition`
gives, :func:`stage_ranges`) with the executor's own compute functions: F as ``module(x)`` or,
for a schedule that splits its backward, :func:`~commlab.pipeline.runtime.compute.forward_layers`;
B as one ``autograd.backward``; I and W as :func:`~commlab.pipeline.runtime.compute.input_grad`
and :func:`~commlab.pipeline.runtime.compute.weight_grad`. The last stage adds the loss, as the
executor's last forward does. Micro-batches alternate as in a steady 1F1B (a forward of the next
micro-batch between two backwards); the stages take turns round by round, and each time is the
median of the rounds: the executor's actions are not each the best of three. Still nothing of
a configuration is run: a stage is timed once per micro-batch size and shared by every
schedule, count and checkpoint mode.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace

from commlab.pipeline.runtime.partition import partition
from commlab.pipeline.schedule.actions import INPUT_GRAD
from commlab.pipeline.schedule.registry import REGISTRY


@dataclass(frozen=True)
class StageTimes:
    """One stage's seconds per micro-batch: F whole and F layer by layer (a split schedule's), B, I,
    W, and F without grad (a checkpointed micro-batch's first forward: the executor runs it under
    ``torch.no_grad``, saving nothing)."""

    forward: float
    split_forward: float
    backward: float
    input_grad: float
    weight_grad: float
    nograd_forward: float = 0.0


def stage_ranges(layer_seconds: Sequence[float], ranks: int, virtuals: Sequence[int], schedules: Iterable[str],
                 balance_mode: str = "time") -> set[tuple[int, int]]:  # fmt: skip
    """Every (first layer, layer count) a stage of a candidate plan can have (what
    :func:`commlab.costmodel.planner.plan.candidates` partitions), for :func:`profile_stages`."""
    layers = len(layer_seconds)
    counts = {ranks * v for name in schedules for v in (REGISTRY[name].virtual or virtuals)}
    out = set()
    for stages in counts:
        if stages > layers:
            continue
        balance = partition(layer_seconds if balance_mode == "time" else [1.0] * layers, stages)
        out |= {(sum(balance[:s]), n) for s, n in enumerate(balance)}
    return out


def needs_split(schedules: Iterable[str]) -> bool:
    return any(INPUT_GRAD in REGISTRY[name].kinds for name in schedules)


def stage_timer(layers: Sequence, sample, loss: Callable | None = None, *, split: bool = True,
                whole: bool = False) -> Callable[[], dict]:  # fmt: skip
    """A function that runs one round of timing one stage (``layers``: its modules in order) on
    ``sample``, its input for one micro-batch (a leaf; requiring grad unless it is the model's
    input), and returns its seconds by key (F, Fn, B; with ``split`` also Fs, I, W); ``loss(y)``:
    the last stage's loss. Two micro-batches are in flight: the next one's forward runs between
    one's forward and its backward."""
    import torch
    from torch import nn

    from commlab.pipeline.runtime.compute import forward_layers, input_grad, weight_grad

    # ``whole``: a traced model's stage, one graph that the executor's split backward cuts at its
    # weight nodes (commlab/pipeline/runtime/weight_split.py), not layer by layer as an nn.Sequential.
    module = _Chain(layers) if whole else nn.Sequential(*layers)

    def root(y):  # what a backward starts from: the loss, or the output with its incoming gradient
        return (loss(y), None) if loss is not None else (y, torch.ones_like(y))

    def forward():
        with torch.enable_grad():
            return root(module(sample))

    def forward_split():
        with torch.enable_grad():
            y, pieces = forward_layers(module, sample)
            return (*root(y), pieces)

    def one_round() -> dict[str, float]:
        times: dict[str, float] = {}

        def timed(key: str, fn: Callable):
            start = time.perf_counter()
            out = fn()
            times[key] = time.perf_counter() - start
            return out

        flight = [timed("F", forward), forward()]
        timed("B", lambda r=flight[0]: torch.autograd.backward(r[0], r[1]) if r[0].requires_grad else None)
        with torch.no_grad():
            timed("Fn", lambda: root(module(sample)))
        if split:
            flight = [timed("Fs", forward_split), forward_split()]
            a = flight[0]
            grad = None if loss is not None else (a[1],)
            timed("I", lambda: input_grad(a[2], grad, a[0] if loss is not None else None))
            timed("W", lambda: weight_grad(a[2]))
        return times

    return one_round


def _stage_times(rounds: list[dict[str, float]]) -> StageTimes:
    med = {key: statistics.median(r[key] for r in rounds) for key in rounds[0]}
    return StageTimes(med["F"], med.get("Fs", med["F"]), med["B"], med.get("I", 0.0), med.get("W", 0.0), med["Fn"])


def time_stage(layers: Sequence, sample, loss: Callable | None = None, *, split: bool = True, repeat: int = 7) -> StageTimes:
    """One stage's :class:`StageTimes`: medians of ``repeat`` rounds of :func:`stage_timer` after an untimed one."""
    one_round = stage_timer(layers, sample, loss, split=split)
    one_round()  # allocates
    times = _stage_times([one_round() for _ in range(repeat)])
    for layer in layers:
        layer.zero_grad(set_to_none=True)
    return times


def _Chain(layers: Sequence):
    """``layers`` run in a row as one module that is not an nn.Sequential (a traced stage's form)."""
    from torch import nn

    class Chain(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList(layers)

        def forward(self, x):
            for layer in self.layers:
                x = layer(x)
            return x

    return Chain()


def profile_stages(layers: Sequence, sample, ranges: Iterable[tuple[int, int]], loss: Callable | None = None, *,
                   split: bool = True, repeat: int = 11, whole: bool = False) -> dict[tuple[int, int], StageTimes]:  # fmt: skip
    """Every (first layer, count) in ``ranges`` of the model's ``layers`` timed (:func:`stage_timer`;
    ``whole``: as a traced stage, one graph),
    each stage on the input the layers before it make from ``sample`` (one micro-batch); ``loss``
    is added to the stage that ends at the last layer. The stages take turns, one round each,
    ``repeat`` times, so a passing burst of load on a shared host hits them all alike; medians."""
    import torch

    layers = list(layers)
    inputs = [sample]
    with torch.no_grad():
        for layer in layers[:-1]:
            inputs.append(layer(inputs[-1]))
    timers = {}
    for start, n in sorted(set(ranges)):
        x = inputs[start].detach().requires_grad_(start > 0 and inputs[start].is_floating_point())
        last = start + n == len(layers)
        timers[(start, n)] = stage_timer(layers[start : start + n], x, loss if last else None, split=split, whole=whole)
        timers[(start, n)]()  # allocates
    rounds: dict[tuple[int, int], list] = {r: [] for r in timers}
    for _ in range(repeat):
        for r, one_round in timers.items():
            rounds[r].append(one_round())
    for layer in layers:
        layer.zero_grad(set_to_none=True)
    return {r: _stage_times(v) for r, v in rounds.items()}


def with_stages(profiles: Mapping[int, object], stages: Mapping[int, Mapping[tuple[int, int], StageTimes]]) -> dict:
    """``profiles`` (one :class:`~commlab.costmodel.planner.plan.LayerProfile` per micro-batch count) with their stage times."""
    return {m: replace(p, stages=dict(stages.get(m, {}))) for m, p in profiles.items()}


def add_stage_times(profiles: Mapping[int, object], layers: Sequence, samples: Mapping[int, object],
                    losses: Mapping[int, Callable] | None, ranks: int, virtuals: Sequence[int], schedules: Iterable[str],
                    balance_mode: str = "time", whole: bool = False) -> dict:  # fmt: skip
    """``profiles`` (per micro-batch count) with every candidate stage timed (:func:`profile_stages`)
    on ``samples[m]``, the last stage with ``losses[m]``; ranges from :func:`stage_ranges`."""
    schedules = list(schedules)
    stages = {}
    for m, p in profiles.items():
        ranges = stage_ranges(p.seconds, ranks, virtuals, schedules, balance_mode)
        stages[m] = profile_stages(layers, samples[m], ranges, (losses or {}).get(m), split=needs_split(schedules), whole=whole)
    return with_stages(profiles, stages)


def co_run(per_rank: Sequence[Mapping[int, Mapping]]) -> dict[int, dict[tuple[int, int], StageTimes]]:
    """Every rank's :func:`commlab.costmodel.planner.model.rank_stage_times` as one :class:`StageTimes` per stage: the median over ranks of each time."""
    out: dict[int, dict[tuple[int, int], StageTimes]] = {}
    for m, stages in per_rank[0].items():
        out[m] = {r: StageTimes(**{k: statistics.median(rank[m][r][k] for rank in per_rank) for k in t}) for r, t in stages.items()}
    return out
