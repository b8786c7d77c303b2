"""A configuration with pipeline stages (pp > 1): the model cut into stages over commlab DDP, timed per step.

The built-in MLP is cut between its Linear layers (each with its ReLU); the GPT becomes an
nn.Sequential of its own modules (embeddings, blocks, norm and head), so that tensor parallelism's
plan (``commlab.tensor.gpt_plan``, by the GPT's names) applies first and the pipeline then cuts
the split blocks, as the 3D tests do. Stages
hold about equal parameter counts (:func:`stage_balance`, a pure function of the model's sizes,
the same on every rank and in the check before any rank starts). Each stage's ``dp`` replicas
are kept in sync by commlab DDP (:class:`commlab.pipeline.runtime.hybrid.DataParallelStage`).

A step is ``accumulate`` pipeline steps of ``microbatches`` micro-batches each, all but the last
under ``no_sync``, then the optimizer. Its row: ``forward`` and ``backward_compute``, this rank's
compute in the synchronised pipeline step (the executor's timeline); ``total``, that pipeline
step; ``comm``, ``exposed_comm`` and the buckets, the stage's DDP reduction; ``pp_send_recv``, the
seconds spent issuing and waiting on the step's point-to-point messages (their waits hold the
schedule's bubble too: a rank waits for a peer that is still computing); ``pp_bubble``, the part
of them the schedule itself leaves idle (:func:`replayed_idle`).
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

import torch
from torch import nn

# One stage per rank: the executor's DDP path times its reduction in DDP's reducer for these.
# Zero-bubble schedules reduce after their last W outside the reducer (hybrid.py), untimed here.
SCHEDULES = ("gpipe", "1f1b")
MODELS = ("mlp", "gpt")


class _Embed(nn.Module):
    """The GPT's token and position embeddings: the first piece."""

    def __init__(self, gpt: nn.Module):
        super().__init__()
        self.tok, self.pos = gpt.tok, gpt.pos

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.tok(tokens) + self.pos(torch.arange(tokens.shape[1], device=tokens.device))


class _Head(nn.Module):
    """The GPT's final norm and head: the last piece."""

    def __init__(self, gpt: nn.Module):
        super().__init__()
        self.norm, self.head = gpt.norm, gpt.head

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(h))


def pieces(name: str, model: nn.Module) -> nn.Sequential:
    """``model`` as an nn.Sequential of the pieces a pipeline may cut between, sharing its modules.
    A layer without parameters (the MLP's ReLU) stays with the layer before it: a stage of it
    alone would have nothing to train, and its rank no optimizer."""
    if name == "gpt":
        return nn.Sequential(_Embed(model), *model.layers, _Head(model))
    if name != "mlp" or not isinstance(model, nn.Sequential):
        raise ValueError(f"--model {name}: a sweep pipelines the built-in {' or '.join(MODELS)} only")
    groups: list[list[nn.Module]] = []
    for layer in model:
        if groups and not any(True for _ in layer.parameters()):
            groups[-1].append(layer)
        else:
            groups.append([layer])
    return nn.Sequential(*(g[0] if len(g) == 1 else nn.Sequential(*g) for g in groups))


def stage_balance(seq: nn.Sequential, pp: int) -> list[int]:
    """Pieces per stage, the largest stage's parameter count made as small as it can be (one
    more per piece, so that every piece weighs something)."""
    from commlab.pipeline.runtime.partition import partition

    return partition([1 + sum(p.numel() for p in piece.parameters()) for piece in seq], pp)


def check_pipeline(cfg) -> None:
    """ValueError, before any rank starts, for what a sweep cannot pipeline: the model, the
    schedule, its micro-batch count, more stages than pieces."""
    from commlab.pipeline.schedule.registry import REGISTRY

    where = f"--pp {cfg.pp}"
    if cfg.model not in MODELS:
        raise ValueError(f"{where} --model {cfg.model}: a sweep cuts the built-in mlp (an nn.Sequential) or gpt "
                         "(embeddings, blocks, head) into stages; use --model mlp or gpt")
    if cfg.schedule not in SCHEDULES:
        known = "" if cfg.schedule in REGISTRY else "unknown; "
        raise ValueError(f"{where} --schedule {cfg.schedule}: {known}a sweep runs {', '.join(SCHEDULES)} (one stage "
                         "per rank, the data-parallel reduction timed by DDP's reducer)")
    try:
        REGISTRY[cfg.schedule].check(cfg.pp, cfg.microbatches, 1)
    except ValueError as err:
        raise ValueError(f"{where} --microbatches {cfg.microbatches}: {err}") from None
    count = _piece_count(cfg.model, cfg.model_args)
    if cfg.pp > count:
        raise ValueError(f"{where}: --model {cfg.model} --model-args {cfg.model_args or '(defaults)'} has "
                         f"{count} pieces to cut between, so at most {count} stages")


@lru_cache(maxsize=None)
def _piece_count(model: str, model_args: str) -> int:  # built once per model and sizes, however many layouts
    from commlab.models import build_workload
    from commlab.runs.options import parse_model_args

    return len(pieces(model, build_workload(model, **parse_model_args(model_args)).model))


@dataclass
class PipelineTrainer:
    """One rank's pipeline for a configuration: its stages (``ddp``: its stage's DDP, None when the
    stage has no parameters), the executor, the optimizer and this rank's part of the batch."""

    cfg: Any
    rt: Any
    stages: Any
    pipe: Any
    ddp: Any
    optimizer: Any
    inputs: Any  # on the first stage's ranks, else None
    target: Any  # on the last stage's ranks, else None
    tensor_parallel: Any = None  # the module commlab.tensor.parallelize returned (tp > 1)
    compute: list = field(default_factory=list)  # per step, per pipeline step in it: action -> seconds

    def now(self) -> float:
        from commlab.runtime.timer import WallClock

        return WallClock(self.rt.device).stamp()

    def _pipeline_step(self, compute: list) -> float:
        from commlab.tensor.timing import start_iteration

        if self.tensor_parallel is not None:  # one tensor-parallel iteration per pipeline step
            start_iteration(self.tensor_parallel)
        self.pipe.step(self.inputs, target=self.target)
        compute.append({t.action: t.end - t.start for t in self.pipe.timeline})
        return self.pipe.p2p_seconds

    def step(self, label=lambda name: nullcontext()) -> dict[str, float]:
        """One optimizer step (``label`` names its phases when profiling); its seconds."""
        from commlab.pipeline.schedule.actions import FORWARD

        start, p2p, compute = self.now(), 0.0, []
        with self.stages.no_sync():
            for _ in range(self.cfg.accumulate - 1):
                with label("commlab:no_sync pipeline step"):
                    p2p += self._pipeline_step(compute)
        synced = self.now()
        with label("commlab:pipeline step (with the gradient all-reduce)"):
            p2p += self._pipeline_step(compute)
        pipeline_end = self.now()
        with label("commlab:optimizer"):
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        end = self.now()
        self.compute.append(compute)
        forward = sum(t.end - t.start for t in self.pipe.timeline if t.action.kind == FORWARD)
        backward = sum(t.end - t.start for t in self.pipe.timeline if t.action.kind != FORWARD)
        return {"forward": forward, "backward_compute": backward, "total": pipeline_end - synced,
                "accumulate_time": synced - start, "optimizer": end - pipeline_end, "step": end - start,
                "pp_send_recv": p2p}


def prepare(cfg, rt, workload) -> PipelineTrainer:
    """This rank's pipeline for ``cfg`` (inside the process group; every rank calls it)."""
    from commlab import DistributedDataParallel
    from commlab.pipeline.runtime.executor import PipelineExecutor
    from commlab.pipeline.runtime.hybrid import DataParallelStage
    from commlab.runs.config import optimizer_of
    from commlab.runs.optimizers import build_optimizer
    from commlab.runtime.topology import Topology
    from commlab.sweep.wrap import ddp_options
    from commlab.tensor import gpt_plan, parallelize, record_timings

    topology = Topology.build(tp=cfg.tp, pp=cfg.pp, dp=cfg.dp)
    model = workload.model
    balance = stage_balance(pieces(cfg.model, model), cfg.pp)  # of the whole model, as check_pipeline counts
    split = None
    if cfg.tp > 1:
        split = parallelize(model, gpt_plan(), group=topology.tp_group, algorithm=cfg.algorithm)
        record_timings(split)
    stages = DataParallelStage(pieces(cfg.model, model), balance, topology, device=rt.device, **ddp_options(cfg))
    pipe = PipelineExecutor(stages, cfg.schedule, microbatches=cfg.microbatches, loss_fn=workload.loss_fn,
                            track_memory=False)
    ddp = next((m for m in stages.modules.values() if isinstance(m, DistributedDataParallel)), None)
    optimizer = build_optimizer(optimizer_of(cfg), stages.parameters())
    # One batch per data-parallel replica, as without stages: its pipeline's ranks share it.
    gen = torch.Generator().manual_seed(1000 + topology.replica)
    inputs, target = (t.to(rt.device) for t in workload.make_batch(cfg.batch_per_rank, gen))
    return PipelineTrainer(cfg, rt, stages, pipe, ddp, optimizer, inputs if stages.is_first else None,
                           target if stages.is_last else None, split)


def measure_steps(trainer: PipelineTrainer) -> tuple[list, list, dict[str, float]]:
    """Time ``warmup + iters`` steps; this rank's iteration rows, bucket rows and measures (the
    bytes its stage's reduction sent; the caller adds the peak)."""
    from commlab.runtime.timer import timed_steps
    from commlab.sweep import layout
    from commlab.sweep.wrap import step_measures
    from commlab.tensor import timings as tensor_timings

    cfg, ddp, steps = trainer.cfg, trainer.ddp, []

    def forget_warmup() -> None:
        if ddp is not None:
            ddp.reset_timings()
        steps.clear()
        trainer.compute.clear()

    timed_steps(lambda: steps.append(trainer.step()), cfg.iters, cfg.warmup, warmed=forget_warmup)
    timings = list(ddp.iteration_timings) if ddp is not None else [None] * len(steps)
    if len(timings) != len(steps):
        raise RuntimeError(f"the stage's DDP recorded {len(timings)} synchronised iterations for {len(steps)} steps")
    axes = [dict.fromkeys(layout.AXIS_COLUMNS, 0.0) for _ in steps] if trainer.tensor_parallel is None else \
        layout.axis_seconds(tensor_timings(trainer.tensor_parallel), cfg.accumulate, len(steps))
    bubbles = replayed_idle(trainer)
    quiet = {"comm": 0.0, "exposed_comm": 0.0, "write_back": 0.0, "unused_allreduce": 0.0}
    iterations, buckets = [], []
    for i, (timing, own, axis, bubble) in enumerate(zip(timings, steps, axes, bubbles)):
        row = {**(timing.as_row() if timing is not None else quiet), **own}
        iterations.append({"rank": trainer.rt.rank, "iteration": i, **row, **axis, "pp_send_recv": own["pp_send_recv"],
                           "pp_bubble": bubble, "dp_reduce": row["comm"]})
        buckets += [{"rank": trainer.rt.rank, "iteration": i, "bucket": b.index, "nbytes": b.nbytes,
                     "num_params": b.num_params, "ready": b.ready, "launched": b.launched, "done": b.done}
                    for b in (timing.buckets if timing is not None else [])]
    return iterations, buckets, step_measures(ddp, cfg, [t for t in timings if t is not None])


def replayed_idle(trainer: PipelineTrainer) -> list[float]:
    """Per timed step, this rank's bubble: its idle seconds when the schedule is replayed on the
    simulator with every pipeline rank's measured compute times and free messages, summed over
    the step's pipeline steps (:func:`commlab.pipeline.schedule.simulate.simulate`). The measured waits hold it and the
    messages' own time; the replay tells them apart. Collective over the pipeline group."""
    import torch.distributed as dist

    from commlab.pipeline.schedule.actions import flatten
    from commlab.pipeline.schedule.registry import build
    from commlab.pipeline.schedule.simulate import simulate

    cfg, stages = trainer.cfg, trainer.stages
    gathered: list = [None] * stages.ranks
    dist.all_gather_object(gathered, trainer.compute, group=stages.group)
    actions = build(cfg.schedule, cfg.pp, cfg.microbatches, 1)
    everything = {a for rank in flatten(actions) for a in rank}
    idle = []
    for k, step in enumerate(trainer.compute):
        idle.append(0.0)
        for j in range(len(step)):
            durations = {a: sec for rank in gathered for a, sec in rank[k][j].items()}
            if set(durations) != everything:  # an action without its measured time would be priced as nothing
                raise RuntimeError(f"the pipeline ranks timed {len(durations)} actions of the schedule's {len(everything)}")
            idle[-1] += simulate(actions, 0.0, 0.0, durations=durations).idle[stages.rank]
    return idle
