"""Predicting DDP from a calibration: profiles, cost terms, the lowering onto commlab.sim, tuning.

    commlab calibrate / commlab predict SPEC / commlab tune        (commlab/predict/cli.py)
    commlab.tune("mlp", world_size=2)                               (this module)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def tune(model_or_name: str, *, model_args: str | dict = "", batch_per_rank: int = 32, backend: str = "gloo",
         world_size: int = 2, threads: int | None = None, algorithms: tuple[str, ...] = ("native", "ring"),
         profile: str | Path | None = None, recalibrate: bool = False) -> dict[str, Any]:
    """Recommend DDP settings for a workload by simulation (calibrating first when needed).

    ``model_or_name`` is a built-in model name or ``package.module:factory`` (ranks are spawned
    and build the model themselves). Returns ``{"ddp_kwargs": {...}, "commlab_kwargs": {...},
    "predicted_step_s": ..., "default_step_s": ...}``; ``ddp_kwargs`` holds only torch DDP keywords.
    """
    from commlab.models import check_workload
    from commlab.predict.calibrate import DEFAULT_PROFILE, Workload, profile_for
    from commlab.predict.session import tune_entry
    from commlab.sweep.spec import canonical_model_args, parse_model_args

    if not isinstance(model_or_name, str):
        raise TypeError("commlab.tune takes a model name or 'package.module:factory' (ranks build the model), "
                        f"got {type(model_or_name).__name__}")
    check_workload(model_or_name, **parse_model_args(model_args))
    if batch_per_rank < 1 or world_size < 1:
        raise ValueError(f"batch_per_rank and world_size must be >= 1, got {batch_per_rank}, {world_size}")
    workload = Workload(model_or_name, canonical_model_args(model_args), batch_per_rank)
    entry = profile_for(workload, backend=backend, world_size=world_size, threads=threads,
                        path=Path(profile) if profile else DEFAULT_PROFILE, recalibrate=recalibrate,
                        algorithms=tuple(algorithms))
    return tune_entry(entry)
