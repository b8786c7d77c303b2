"""commlab's pipeline vs torch.distributed.pipelining in separate launches, alternating, on the GPT-style model.

``commlab pipeline bench --against torch`` runs each launch with one implementation only, so neither
shares a process, an allocator or a warm cache with the other: launch 2k runs commlab then torch,
launch 2k+1 torch then commlab (ABBA), so a slow drift of a shared machine hits both alike. Both
run :class:`commlab.models.GPT` (seeded), cut by name at the same split points by commlab's
traced cut (:func:`commlab.pipeline.runtime.traced.trace_stages`); torch's manual
``PipelineStage`` wraps those same pieces (its traced stages assume the looping placement, which
the V schedules do not use), with the same schedule (``ScheduleSpec.torch``), on Gloo. A launch's
time is the median over its timed steps of the step time, taken between two barriers on every
rank (the slowest rank's). Each round gives the ratio commlab / torch; the summary is its median
with the p10-p90 spread over the rounds.
"""

from __future__ import annotations

import statistics
import warnings
from collections.abc import Callable
from typing import Any

from commlab.pipeline.schedule.registry import REGISTRY

DEFAULTS = dict(layers=4, d_model=64, heads=4, seq=32, vocab=256, batch=16, iters=10, warmup=3)


def split_points(schedule: str, world: int, layers: int) -> list[str]:
    """The GPT's cut for ``schedule`` at ``world`` ranks: its blocks in equal runs, one per stage
    (the embeddings ride with the first stage, the norm and head with the last)."""
    spec = REGISTRY[schedule]
    stages = world * (spec.virtual[0] if spec.virtual else 2)  # interleaved: two stages per rank
    if layers < stages:
        raise ValueError(f"{schedule} on {world} ranks has {stages} stages: the GPT needs at least {stages} layers, got {layers}")
    return [f"layers.{(layers * s) // stages}" for s in range(1, stages)]


def check(schedules: list[str], microbatches: list[int], world: int, launches: int, sizes: dict[str, int]) -> None:
    """ValueError for anything a launch would fail on, before any process starts."""
    cfg = {**DEFAULTS, **sizes}
    batch = cfg["batch"]
    if cfg["d_model"] % cfg["heads"]:
        raise ValueError(f"the GPT's width {cfg['d_model']} must be a multiple of its {cfg['heads']} heads")
    for name in schedules:
        if REGISTRY[name].torch is None:
            with_torch = [n for n, s in REGISTRY.items() if s.torch]
            raise ValueError(f"schedule {name!r} has no torch.distributed.pipelining counterpart: choose from {', '.join(with_torch)}")
        stages = len(split_points(name, world, cfg["layers"])) + 1
        for m in microbatches:
            REGISTRY[name].check(world, m, stages // world)
            if batch % m:
                raise ValueError(f"--batch {batch} does not split into {m} equal micro-batches (the traced shapes are static)")
    if launches < 1:
        raise ValueError(f"--launches must be >= 1, got {launches}")


def _rank(impl: str, cfg: dict[str, Any]) -> list[float]:
    """One launch's rank: ``warmup`` then ``iters`` timed steps of ``impl``; the step times."""
    import torch
    import torch.distributed as dist

    from commlab.models import GPT, lm_loss
    from commlab.runtime.timer import timed_steps

    warnings.filterwarnings("ignore")  # torch.export's deprecation chatter
    torch.manual_seed(0)
    model = GPT(vocab=cfg["vocab"], d_model=cfg["d_model"], layers=cfg["layers"], heads=cfg["heads"], seq=cfg["seq"])
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, cfg["vocab"], (cfg["batch"], cfg["seq"]), generator=gen)
    target = torch.roll(tokens, -1, dims=1)
    world, rank, m, name = dist.get_world_size(), dist.get_rank(), cfg["microbatches"], cfg["schedule"]
    points = split_points(name, world, cfg["layers"])
    placement = REGISTRY[name].placement(world, len(points) + 1)
    example = (tokens[: cfg["batch"] // m],)
    first, last = placement[0] == rank, placement[-1] == rank
    if impl == "commlab":
        from commlab.pipeline.runtime.executor import PipelineExecutor
        from commlab.pipeline.runtime.stages import RankStages

        stage = RankStages(model, placement=placement, split_points=points, example_args=example)
        run = PipelineExecutor(stage, name, microbatches=m, loss_fn=lm_loss, track_memory=False).step
    else:
        from torch.distributed.pipelining import PipelineStage, schedules

        from commlab.pipeline.runtime.traced import trace_stages

        cut = trace_stages(model, points, example)
        stages = [PipelineStage(_piece(cut.parts[s]), s, len(placement), torch.device("cpu"))
                  for s in range(len(placement)) if placement[s] == rank]  # fmt: skip
        run = getattr(schedules, REGISTRY[name].torch)(stages if len(stages) > 1 else stages[0], n_microbatches=m,
                                                       loss_fn=lm_loss).step  # fmt: skip

    def step() -> None:
        run(*((tokens,) if first else ()), target=target if last else None)
        dist.barrier()  # the slowest rank's step

    return timed_steps(step, cfg["iters"], cfg["warmup"], before=lambda: (model.zero_grad(set_to_none=True), dist.barrier()))


def _piece(part):
    """A piece of commlab's cut as torch's PipelineStage calls it: the tensors as arguments (the
    class is made here so that this module loads without torch, for the CLI's help)."""
    from torch import nn

    class Piece(nn.Module):
        def __init__(self):
            super().__init__()
            self.part = part

        def forward(self, *tensors):
            return self.part(tensors)

    return Piece()


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    at = (len(ordered) - 1) * q
    low = int(at)
    return ordered[low] + (ordered[min(low + 1, len(ordered) - 1)] - ordered[low]) * (at - low)


def against_torch(schedule: str, microbatches: int, launches: int, world: int = 2, backend: str = "gloo",
                  timeout: float = 600.0, echo: Callable[[str], None] = print, **sizes) -> dict[str, Any]:  # fmt: skip
    """Alternating launches of one schedule (module docstring): per-launch medians and the ratio's summary."""
    import commlab

    cfg = {**DEFAULTS, **sizes, "schedule": schedule, "microbatches": microbatches}
    out: dict[str, list[float]] = {"commlab": [], "torch": []}
    for k in range(launches):
        for impl in ("commlab", "torch") if k % 2 == 0 else ("torch", "commlab"):
            per_rank = commlab.launch(_rank, impl, cfg, world_size=world, backend=backend, timeout=timeout)
            out[impl].append(statistics.median(max(ts) for ts in zip(*per_rank)))
        echo(f"{schedule} m={microbatches} round {k + 1}/{launches}: commlab {out['commlab'][-1] * 1e3:.2f} ms, "
             f"torch {out['torch'][-1] * 1e3:.2f} ms")  # fmt: skip
    ratios = [c / t for c, t in zip(out["commlab"], out["torch"])]
    return dict(schedule=schedule, microbatches=microbatches, commlab_s=out["commlab"], torch_s=out["torch"], ratios=ratios,
                ratio=statistics.median(ratios), p10=_percentile(ratios, 0.1), p90=_percentile(ratios, 0.9))  # fmt: skip


def write_csv(path, rows: list[dict[str, Any]]) -> None:
    """One line per round: schedule, micro-batches, round, commlab and torch seconds, their ratio."""
    import csv
    from pathlib import Path

    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        out = csv.writer(f)
        out.writerow(["schedule", "microbatches", "round", "commlab_s", "torch_s", "ratio"])
        for row in rows:
            for k, (c, t, r) in enumerate(zip(row["commlab_s"], row["torch_s"], row["ratios"])):
                out.writerow([row["schedule"], row["microbatches"], k, f"{c:.6g}", f"{t:.6g}", f"{r:.6g}"])


def summary(row: dict[str, Any]) -> str:
    return (f"{row['schedule']:<12} m={row['microbatches']:<3} commlab/torch {row['ratio']:.3f} "
            f"(p10 {row['p10']:.3f}, p90 {row['p90']:.3f}; {len(row['ratios'])} rounds, medians "
            f"{statistics.median(row['commlab_s']) * 1e3:.2f} / {statistics.median(row['torch_s']) * 1e3:.2f} ms)")  # fmt: skip
