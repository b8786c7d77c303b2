"""Narayanan et al.'s Table 1 (SC 2021) against the 3D lowering, and the one A100 efficiency.

Every row of megatron.yaml is a GPT and a layout; its prediction is
:func:`commlab.costmodel.lowering.layout3d.predict` on the ``dgx-a100-hdr200`` preset, whose
device runs every operator at one efficiency of its roofline. That efficiency is not a preset
input: it is derived here, once, from one stated row (:data:`CALIBRATION_ROW`), and every other
row of both tables (this one and Korthikanti et al.'s) is predicted with it, unchanged.

Why the 1.7B row: no tensor and no pipeline parallelism, one micro-batch per replica, and a
data-parallel all-reduce of about 1% of its step, so its time is nearly all the device's own
compute: the efficiency it gives measures the device, not the network model (which the other
rows then test). Its error is 0 by construction: it is printed, marked "(fitted)", and left out
of the summary (commlab/validation/published/report.py).
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import yaml

from commlab.costmodel.hardware.presets import load_preset
from commlab.costmodel.lowering.layout3d import Iteration, Layout, machine_on, predict
from commlab.costmodel.lowering.transformer import GPT
from commlab.validation.published.report import FITTED

DATA = Path(__file__).with_name("megatron.yaml")
CALIBRATION_ROW = "1.7B"
TABLE = "megatron"


@functools.cache
def table(path: Path = DATA) -> dict[str, Any]:
    return yaml.safe_load(path.read_text())


def gpt_and_layout(row: dict[str, Any], common: dict[str, Any], **overrides: Any) -> tuple[GPT, Layout]:
    """The GPT and the layout one published row ran (``overrides``: recompute, sequence_parallel)."""
    merged = {**common, **row, **overrides}
    gpt = GPT(int(merged["layers"]), int(merged["hidden"]), int(merged["heads"]), int(merged["seq"]), int(merged["vocab"]))
    virtual = int(merged.get("virtual", 1))
    layout = Layout(int(merged["tp"]), int(merged["pp"]), int(merged["dp"]), int(merged["micro_batch"]),
                    int(merged["global_batch"]), str(merged.get("schedule", "interleaved" if virtual > 1 else "1f1b")),
                    virtual, str(merged["recompute"]), bool(merged["sequence_parallel"]))
    layout.check(gpt, int(merged["gpus"]))
    return gpt, layout


def predict_row(row: dict[str, Any], efficiency: float, **overrides: Any) -> Iteration:
    data = table()
    gpt, layout = gpt_and_layout(row, data["common"], **overrides)
    return predict(gpt, layout, machine_on(load_preset(data["hardware"]), efficiency), int(row["gpus"]))


@functools.cache
def efficiency() -> float:
    """The A100's one efficiency: the value at which :data:`CALIBRATION_ROW`'s predicted TFLOP/s
    per GPU equals the published one (bisection; the prediction rises with the efficiency)."""
    row = next(r for r in table()["rows"] if r["case"] == CALIBRATION_ROW)
    low, high = 0.01, 1.0
    if predict_row(row, high).tflops_per_gpu < row["published"]:
        raise ValueError(f"row {CALIBRATION_ROW}: even a perfect device falls short of the published figure")
    for _ in range(50):
        mid = (low + high) / 2
        low, high = (mid, high) if predict_row(row, mid).tflops_per_gpu < row["published"] else (low, mid)
    return (low + high) / 2


def rows() -> list[dict]:
    """Every Table 1 row: published and predicted TFLOP/s per GPU (Narayanan et al.'s equation 3
    over the predicted iteration time), at the one efficiency."""
    data, eff = table(), efficiency()
    out = []
    for row in data["rows"]:
        predicted = predict_row(row, eff).tflops_per_gpu
        fitted = row["case"] == CALIBRATION_ROW
        note = f" (the efficiency's own row: {eff:.3f} of the roofline)" if fitted else ""
        out.append({"table": TABLE, "case": f"{row['case']} {FITTED}" if fitted else row["case"], "metric": data["metric"], "published": float(row["published"]),
                    "predicted": predicted, "error": predicted / row["published"] - 1,
                    "source": f"{row['table']}{note}; {data['source']}"})
    return out
