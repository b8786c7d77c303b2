"""Korthikanti et al.'s Table 5 (MLSys 2023) against the 3D lowering, at Table 1's efficiency.

Each model of korthikanti.yaml runs twice: tensor parallelism with full recomputation, and
tensor plus sequence parallelism with selective recomputation. Both are predicted with the A100
efficiency derived from Narayanan et al.'s Table 1 (:func:`commlab.validation.published.megatron.
efficiency`), not refitted. Three rows per model: each time, and their ratio (the paper's claim).
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import yaml

from commlab.costmodel.hardware.presets import load_preset
from commlab.costmodel.lowering.layout3d import machine_on, predict
from commlab.validation.published import megatron

DATA = Path(__file__).with_name("korthikanti.yaml")
TABLE = "korthikanti"
MODES = {"full": {"recompute": "full", "sequence_parallel": False},
         "selective_sp": {"recompute": "selective", "sequence_parallel": True}}


@functools.cache
def table(path: Path = DATA) -> dict[str, Any]:
    return yaml.safe_load(path.read_text())


def rows() -> list[dict]:
    data, eff = table(), megatron.efficiency()
    machine = machine_on(load_preset(data["hardware"]), eff)
    out = []
    for row in data["rows"]:
        seconds = {}
        for mode, overrides in MODES.items():
            gpt, layout = megatron.gpt_and_layout(row, data["common"], **overrides)
            seconds[mode] = predict(gpt, layout, machine, int(row["gpus"])).seconds
            out.append(_row(row, f"{row['case']} {mode}", data["metric"], row[mode], seconds[mode], data["source"]))
        out.append(_row(row, f"{row['case']} ratio", "selective_sp / full", row["selective_sp"] / row["full"],
                        seconds["selective_sp"] / seconds["full"], data["source"]))
    return out


def _row(row: dict[str, Any], case: str, metric: str, published: float, predicted: float, source: str) -> dict:
    return {"table": TABLE, "case": case, "metric": metric, "published": float(published), "predicted": predicted,
            "error": predicted / published - 1, "source": f"{row['table']}; {source}"}
