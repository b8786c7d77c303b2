"""The cost model's Python entry point: ``commlab.tune`` (the CLI's is commlab/cli/predict.py)."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import torch

from commlab.costmodel.calibration.driver import DEFAULT_CALIBRATION, Workload, calibration_for
from commlab.costmodel.search.module_store import as_name
from commlab.costmodel.search.grid_costs import tune_algorithms, tune_entry
from commlab.costmodel.search.tune_sharded import parse_stages, sharded_answer
from commlab.models import check_workload
from commlab.runs.options import canonical_model_args, parse_model_args


def tune(model_or_name: str | torch.nn.Module, *, model_args: str | dict = "", batch_per_rank: int = 32,
         backend: str = "gloo", world_size: int = 2, threads: int | None = None,
         algorithms: tuple[str, ...] | None = None, calibration: str | Path | None = None,
         recalibrate: bool = False, bucket_policies: tuple = ("size_cap",), force: bool = False,
         stage: int | str | None = None, memory_gb: float | None = None, optimizer_bytes: float = 0.0,
         profile: str | Path | None = None) -> dict[str, Any]:
    """Recommend DDP settings for a workload by simulation (calibrating first when needed).

    ``model_or_name`` is a built-in model name, ``package.module:factory``, or an ``nn.Module``
    instance (saved once, whole, so that the spawned ranks can load it: commlab/costmodel/search/module_store.py;
    its input shape comes from an ``input_shape`` attribute or its first Linear, as for a factory).
    Returns what ``commlab tune --json`` prints for the same inputs::

        {"torch": {"ddp_kwargs": {...}, "predicted_step_s": ..., "interval_s": [low, high]},
         "commlab": {"ddp_kwargs": {...}, "commlab_kwargs": {...}, "predicted_step_s": ..., "interval_s": [...]},
         "default_step_s": ..., "steady": True}

    ``torch.ddp_kwargs`` holds only torch DDP keywords, priced with torch's bucket rules
    (commlab/costmodel/search/tune.py). ``algorithms``: those searched (default: every registered
    all-reduce algorithm, whatever the calibration cache holds). ``calibration``: the calibration
    file (default ``~/.cache/commlab/calibration.json``; ``profile``, its old name, warns).
    ``bucket_policies``: the bucket policies searched (names or instances, commlab/ddp/policy.py). When the calibration was
    unsteady (commlab/costmodel/terms/uncertainty.py) both answers are torch's default unless ``force``.

    ``stage`` ("auto" or 0-3) adds a ``"sharded"`` answer (commlab/costmodel/search/tune_sharded.py):
    the fastest predicted stage x bucket x prefetch x reshard whose predicted peak per rank fits
    ``memory_gb`` GiB, with ``optimizer_bytes`` of optimizer state per parameter (0: plain SGD,
    8: Adam); ValueError naming the smallest peak when nothing fits.
    """
    if profile is not None:
        warnings.warn("commlab.tune(profile=...) is deprecated and will be removed in a later release: use "
                      "calibration=...", FutureWarning, stacklevel=2)
        if calibration is not None:
            raise ValueError("give calibration= only (profile= is its old name)")
        calibration = profile
    stages = None if stage is None else parse_stages(stage)
    if memory_gb is not None and (stages is None or not memory_gb > 0):
        raise ValueError(f"memory_gb needs a stage ('auto' or 0-3) and must be positive, got {memory_gb!r}")
    if isinstance(model_or_name, torch.nn.Module):
        if model_args:
            raise ValueError("model_args are the sizes of a named model; an nn.Module instance takes none")
        model_or_name, model_args = as_name(model_or_name)
    elif not isinstance(model_or_name, str):
        raise TypeError("commlab.tune takes an nn.Module, a model name or 'package.module:factory', "
                        f"got {type(model_or_name).__name__}")
    check_workload(model_or_name, **parse_model_args(model_args))
    if batch_per_rank < 1 or world_size < 1:
        raise ValueError(f"batch_per_rank and world_size must be >= 1, got {batch_per_rank}, {world_size}")
    workload = Workload(model_or_name, canonical_model_args(model_args), batch_per_rank)
    names = tuple(dict.fromkeys(("native", *(tune_algorithms() if algorithms is None else algorithms))))
    entry = calibration_for(workload, backend=backend, world_size=world_size, threads=threads,
                            path=Path(calibration) if calibration else DEFAULT_CALIBRATION, recalibrate=recalibrate,
                            algorithms=names, sharded=stages is not None and stages != (0,))
    result = tune_entry(entry, algorithms=names, policies=tuple(bucket_policies), force=force)
    if stages is not None:
        result["sharded"] = sharded_answer(entry, stages=stages, algorithms=names, optimizer_bytes=optimizer_bytes,
                                           memory_bytes=None if memory_gb is None else memory_gb * 2**30,
                                           force=force)
    return result
