"""Published DDP step times on V100 clusters against the model's prediction on the V100 preset.

    from commlab.validation.published import ddp_paper
    for row in ddp_paper.rows(): print(row)      # published, predicted, error, source

The held-out rows live in ddp_paper.yaml beside this module (what they are, where from, how read,
and why the DDP paper's own figures are not among them). Each prediction runs the ``--hardware``
path unchanged (commlab/costmodel/search/grid_costs.py ``predict_on``: FLOPs on the meta device,
NCCL's tuner model for the all-reduce, the DDP lowering on the simulator core) on the
``dgx1-v100-edr100`` preset, with one change stated: the V100's compute efficiency is not the
preset's assumed 0.4 but the one that reproduces the single row ``efficiency_row`` names (ResNet50
on one GPU, where no communication runs), solved from two predictions, then used for every row
and model. That row's error is 0 by construction and it is left out of :func:`rows`.

Gloo is not priced (the source measured NCCL only, and commlab prices Gloo from a calibration of
this machine, not on a preset) and BERT has no row: ddp_paper.yaml's ``skipped`` says why.
"""

from __future__ import annotations

import functools
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import yaml

from commlab.costmodel.hardware.presets import load_preset
from commlab.costmodel.search.grid_costs import predict_on
from commlab.runs.config import Config
from commlab.runs.options import canonical_model_args

DATA = Path(__file__).with_name("ddp_paper.yaml")
# Never created: predict_on would take a V100 calibration from a calibration file in place of the
# FLOPs, and these rows are priced from FLOPs at one stated efficiency, whatever a user has cached.
NO_CALIBRATION = DATA.with_name("no-calibration.json")
FACTORY = "commlab.validation.published.resnet:resnet"
TABLE_LATENCY, TABLE_BUCKET = "ddp-benchmark latency", "ddp-benchmark bucket 1/25 MB"


@functools.lru_cache(maxsize=1)
def load() -> dict[str, Any]:
    """The held-out data file, read once."""
    return yaml.safe_load(DATA.read_text())


def config(model: str, gpus: int, bucket_mb: float = 25.0) -> Config:
    """One DDP step as the source ran it: NCCL, overlap on, batch per GPU fixed (weak scaling)."""
    data = load()
    batch = int(data["batch_per_gpu"])
    return Config(model=FACTORY, model_args=canonical_model_args(data["models"][model]), backend="nccl",
                  world_size=gpus, bucket_mb=float(bucket_mb), algorithm="native", overlap=True, accumulate=1,
                  groups=1, threads=1, scaling="weak", global_batch=batch * gpus, batch_per_rank=batch,
                  iters=10, warmup=5)


def predict(cases: list[tuple[str, int, float]], efficiency: float) -> dict[tuple[str, int, float], float]:
    """(model, gpus, bucket MB) -> predicted seconds per iteration at the given compute efficiency.
    Cases of a model share one plan, so its FLOPs are counted once."""
    preset = {**load_preset(load()["machine"]), "compute_fraction": efficiency}
    configs = {case: config(*case) for case in cases}
    records, _ = predict_on(SimpleNamespace(configs=list(configs.values())), preset, NO_CALIBRATION)
    by_id = {rec["config"]["config"]: rec["iterations"][0]["step"] for rec in records}
    return {case: by_id[cfg.id] for case, cfg in configs.items()}


def _one_row(model: str, gpus: int) -> float:
    found = [r["seconds"] for r in load()["latency"] if (r["model"], r["gpus"]) == (model, gpus)]
    if len(found) != 1:
        raise ValueError(f"ddp_paper.yaml: efficiency_row {model} at {gpus} GPUs matches {len(found)} latency rows")
    return float(found[0])


@functools.lru_cache(maxsize=1)
def efficiency() -> float:
    """The fraction of the V100's peak that makes the efficiency row's predicted step its published
    one. On one GPU no collective runs, so the predicted step is A / efficiency + B exactly (the
    forward and backward scale with 1 / efficiency; the optimizer, write-back and per-bucket costs
    do not): two predictions give A and B, and the root follows."""
    row = load()["efficiency_row"]
    if int(row["gpus"]) != 1:
        raise ValueError(f"ddp_paper.yaml: efficiency_row must be a one-GPU row (no communication), got {row}")
    target, case = _one_row(row["model"], 1), (row["model"], 1, 25.0)
    t_half, t_full = predict([case], 0.5)[case], predict([case], 1.0)[case]
    a = t_half - t_full  # A / 0.5 - A / 1.0
    b = t_full - a
    if not (0 < a and b < target):
        raise ValueError(f"{row}: no efficiency reproduces the published {target} s "
                         f"(compute {a} s at peak, the rest {b} s)")
    eff = a / (target - b)
    if not 0 < eff <= 1:
        raise ValueError(f"{row}: the published {target} s needs {eff:.2f} of the V100's peak")
    return eff


def bucket_ordering(model: str, gpus: int, sizes: tuple[float, ...] = (1.0, 25.0),
                    eff: float | None = None) -> list[float]:
    """Bucket sizes (MB) from the fastest predicted step to the slowest."""
    eff = efficiency() if eff is None else eff
    times = predict([(model, gpus, s) for s in sizes], eff)
    return sorted(sizes, key=lambda s: times[(model, gpus, s)])


def published_ordering(row: dict[str, Any]) -> list[float]:
    """A bucket row's published order of 1 and 25 MB: 25 MB first when it ran faster."""
    return [25.0, 1.0] if row["change"] < 0 else [1.0, 25.0]


@functools.lru_cache(maxsize=1)
def _rows() -> tuple[dict[str, Any], ...]:
    data, eff = load(), efficiency()
    skip = (data["efficiency_row"]["model"], int(data["efficiency_row"]["gpus"]))
    latency = [r for r in data["latency"] if (r["model"], r["gpus"]) != skip]
    cases = [(r["model"], int(r["gpus"]), 25.0) for r in latency]
    cases += [(r["model"], int(r["gpus"]), b) for r in data["bucket"] for b in (1.0, 25.0)]
    predicted = predict(sorted(set(cases)), eff)
    note = f"{data['source']}; V100 at {eff:.3f} of FP32 peak, from {skip[0]} on {skip[1]} GPU"
    out = []
    for r in latency:
        p = predicted[(r["model"], int(r["gpus"]), 25.0)]
        out.append(_row(TABLE_LATENCY, f"{r['model']} {r['gpus']} GPUs 25 MB", "s/iter p50", r["seconds"], p,
                        f"{note}; read: {r['read']}"))
    for r in data["bucket"]:
        ratio = predicted[(r["model"], int(r["gpus"]), 1.0)] / predicted[(r["model"], int(r["gpus"]), 25.0)]
        out.append(_row(TABLE_BUCKET, f"{r['model']} {r['gpus']} GPUs", "step 1 MB / step 25 MB (p75)",
                        1.0 / (1.0 + r["change"]), ratio,
                        f"{note}; read: diff table, throughput change {r['change']:+.1%}"))
    return tuple(out)


def _row(table: str, case: str, metric: str, published: float, predicted: float, source: str) -> dict[str, Any]:
    return {"table": table, "case": case, "metric": metric, "published": float(published),
            "predicted": float(predicted), "error": float(predicted) / float(published) - 1.0, "source": source}


def rows() -> list[dict[str, Any]]:
    """Every held-out row with the model's prediction and its error (predicted / published - 1)."""
    return [dict(r) for r in _rows()]
