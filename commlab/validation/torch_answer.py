"""`commlab tune`'s torch answer measured with torch's own DDP against a grid of bucket sizes.

    commlab validate torch-answer --model mlp --grid 1,5,25,100 --iters 20

Asks the tuner (``commlab.tune``, calibrating when needed) for its torch answer, then measures it
beside torch's default and every cap of the grid in one launch at the tuned world size: each
configuration wraps its own copy of the model in ``torch.nn.parallel.DistributedDataParallel``
with only the answer's keywords; iterations go round-robin over the configurations (in reverse
on odd rounds), so a drift of the machine's speed hits every one alike; a step is forward +
backward + SGD step, its time the slowest rank's. The pick passes when its median is within 5%
of the grid's best (the acceptance of the torch answer).
"""

from __future__ import annotations

import functools
import statistics
from typing import Any

import commlab
from commlab.costmodel.calibration.driver import default_threads
from commlab.runs.options import parse_model_args
from commlab.runtime.threads import use_rank_threads
from commlab.runtime.timer import timed_rounds

TOLERANCE = 0.05


def _measure_rank(spec: dict[str, Any]) -> dict[str, list[float]]:
    # Lazy: spawned ranks import what they run; the CLI part needs no torch (start-up).
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    from commlab.models import build_workload

    use_rank_threads(dist.get_world_size(), fixed=spec.get("threads"))
    models, opts = {}, {}
    for label, kwargs in spec["configs"].items():
        torch.manual_seed(0)
        work = build_workload(spec["model"], **spec["model_kwargs"])
        models[label] = TorchDDP(work.model, **kwargs)
        opts[label] = torch.optim.SGD(models[label].parameters(), lr=1e-4)
    gen = torch.Generator().manual_seed(1 + dist.get_rank())
    x, y = work.make_batch(spec["batch_per_rank"], gen)

    def step(label: str) -> None:
        opts[label].zero_grad()
        work.loss_fn(models[label](x), y).backward()
        opts[label].step()

    return timed_rounds({label: functools.partial(step, label) for label in models}, spec["iters"], spec["warmup"],
                        before=lambda _label: dist.barrier())["seconds"]


def label_of(ddp_kwargs: dict[str, Any]) -> str:
    return f"bucket_cap_mb={ddp_kwargs['bucket_cap_mb']:g}" if ddp_kwargs else "default"


def judge(medians: dict[str, float], pick: str, grid: list[str]) -> dict[str, Any]:
    """The pick's median against the best of the grid (pure)."""
    best = min(grid, key=medians.__getitem__)
    over = medians[pick] / medians[best] - 1.0
    return {"pick": pick, "pick_s": medians[pick], "best": best, "best_s": medians[best], "over": over,
            "within": over <= TOLERANCE}


def slowest_rank(per_rank: list[dict[str, list[float]]]) -> dict[str, float]:
    """Median over iterations of the slowest rank's time, per configuration (pure)."""
    return {label: statistics.median(max(r[label][i] for r in per_rank) for i in range(len(per_rank[0][label])))
            for label in per_rank[0]}


def check(model: str, model_args: str, *, grid_mb: list[float], world_size: int = 2, batch_per_rank: int = 32,
          iters: int = 20, warmup: int = 3, calibration=None, force: bool = False, timeout: float = 900.0,
          echo=lambda _l: None) -> dict[str, Any]:
    """Tune, then measure the torch answer beside torch's default and ``grid_mb`` (one launch)."""
    answer = commlab.tune(model, model_args=model_args, world_size=world_size, batch_per_rank=batch_per_rank,
                          calibration=calibration, force=force)
    pick = label_of(answer["torch"]["ddp_kwargs"])
    echo(f"tune's torch answer: {pick}, predicted {answer['torch']['predicted_step_s'] * 1e3:.1f} ms "
         f"(steady calibration: {answer['steady']})")
    configs = {"default": {}, **{label_of({"bucket_cap_mb": mb}): {"bucket_cap_mb": mb} for mb in grid_mb}}
    configs[pick] = answer["torch"]["ddp_kwargs"]
    spec = {"model": model, "model_kwargs": parse_model_args(model_args), "batch_per_rank": batch_per_rank,
            "configs": configs, "iters": iters, "warmup": warmup, "threads": default_threads(world_size)}
    medians = slowest_rank(commlab.launch(_measure_rank, spec, world_size=world_size, backend="gloo",
                                          timeout=timeout))
    grid = [label for label in configs if label != pick] or [pick]
    return {"answer": answer, "medians": medians, **judge(medians, pick, grid)}
