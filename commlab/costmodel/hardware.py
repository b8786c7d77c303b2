"""Hardware presets: a named machine's collective costs (and a compute scale) instead of this one's.

Presets live in commlab/costmodel/hardware.yaml (each with its numbers' sources); a path to a YAML
file of the same form works too. See that file for the all-reduce model.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from commlab.costmodel.costs import CollectiveCost, Overheads, SystemCosts
from commlab.costmodel.lower import StepCosts, step_costs
from commlab.costmodel.predict import profile_from_entry

PRESETS = Path(__file__).with_name("hardware.yaml")
FIELDS = ("gpus_per_node", "intra_busbw_gbps", "inter_busbw_gbps", "intra_hop_s", "inter_hop_s", "compute_speedup", "source")


def preset_names() -> list[str]:
    return sorted(yaml.safe_load(PRESETS.read_text()))


def load_preset(name: str) -> dict[str, Any]:
    """The preset called ``name`` (or read from a YAML file at that path); ValueError if unknown."""
    if Path(name).suffix in (".yaml", ".yml") and Path(name).exists():
        data = yaml.safe_load(Path(name).read_text())
        if isinstance(data, dict) and len(data) == 1:
            name, preset = next(iter(data.items()))
        else:
            raise ValueError(f"--hardware {name}: the file must hold exactly one preset (name: fields)")
    else:
        presets = yaml.safe_load(PRESETS.read_text())
        if name not in presets:
            raise ValueError(f"--hardware: unknown preset {name!r}: choose from {', '.join(sorted(presets))} or give a .yaml file")
        preset = presets[name]
    missing = [f for f in FIELDS if f not in (preset or {})]
    if missing:
        raise ValueError(f"--hardware {name}: missing field(s) {', '.join(missing)}")
    for f in FIELDS[:-1]:
        if not float(preset[f]) > 0:
            raise ValueError(f"--hardware {name}: {f} must be positive")
    assumptions = (f"ring all-reduce at {preset['intra_busbw_gbps']} GB/s busbw within {preset['gpus_per_node']} GPUs, "
                   f"{preset['inter_busbw_gbps']} GB/s across nodes; compute = this machine's / {preset['compute_speedup']} "
                   f"(assumed); no compute/comm contention; source: {preset['source']}")
    return {"name": name, **preset, "assumptions": assumptions}


def allreduce_cost(preset: dict[str, Any], world_size: int) -> CollectiveCost:
    """NCCL's ring model on this preset (hardware.yaml's header)."""
    n = world_size
    if n == 1:
        return CollectiveCost.line(0.0, float("inf"))
    inter = n > preset["gpus_per_node"]
    busbw = float(preset["inter_busbw_gbps" if inter else "intra_busbw_gbps"]) * 1e9
    hop = float(preset["inter_hop_s" if inter else "intra_hop_s"])
    return CollectiveCost.line(2 * (n - 1) * hop, busbw * n / (2 * (n - 1)))


def costs_on(preset: dict[str, Any], entry: dict, world_size: int, algorithm: str = "native") -> StepCosts:
    """The lowering's costs: compute from a world-size-1 profile entry, scaled; the preset's all-reduce
    (the same line whatever the algorithm); no contention, no co-run stretch."""
    c, s = entry["compute"], float(preset["compute_speedup"])
    system = SystemCosts(collectives={("allreduce", algorithm, world_size): allreduce_cost(preset, world_size)},
                         overheads=Overheads(bucket_fixed_s=c["bucket_fixed_s"] / s,
                                             writeback_s_per_byte=c["writeback_s_per_byte"] / s))
    return step_costs(system, profile_from_entry(entry).scaled(s), algorithm, world_size)
