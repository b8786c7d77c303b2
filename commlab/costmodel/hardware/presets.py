"""Hardware presets: a named machine's network and device instead of this one's (what-if).

Presets live in commlab/costmodel/hardware.yaml, each number with its source; a path to a YAML
file of the same form works too. A preset's all-reduce is priced by NCCL's own tuning model
(commlab/costmodel/hardware/nccl.py). A workload's compute on it comes from, in this order:

1. a calibration made on one device of the preset's kind (``commlab calibrate --backend nccl
   --world-size 1`` on that machine, then the calibration file copied here): the measured
   forward, gradient ready times, optimizer, write-back and per-bucket cost, used as they are;
2. otherwise the model's FLOPs at the preset's stated fraction of the device's peak
   (commlab/costmodel/hardware/flops.py), the optimizer and write-back as memory traffic at the
   device's HBM bandwidth.

Every figure is labelled predicted, with the assumptions it rests on (:func:`assumptions`).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import yaml

from commlab._lazy import renamed_getattr
from commlab.costmodel.hardware import flops as flop_model
from commlab.costmodel.hardware import nccl
from commlab.costmodel.terms.costs import Contention, DDPProfile, Overheads, SystemCosts
from commlab.runs.traffic import REPLICATE_ALL_REDUCE

PRESETS = Path(__file__).with_name("hardware.yaml")
NUMBERS = ("gpus_per_node", "nvlink_busbw_gbps", "nic_busbw_gbps", "nics_per_node", "channels",
           "peak_tflops", "hbm_gbps", "compute_fraction")
FIELDS = (*NUMBERS, "overlap_slowdown", "arch", "cpu", "device", "source")
# ASSUMED, for the FLOPs path: the reducer's own time per bucket (a few kernel launches and
# bookkeeping) and the optimizer's memory traffic (fp32 parameter, gradient and two moments
# read, three written: 7 x 4 bytes per parameter, Adam).
BUCKET_FIXED_S = 20e-6
OPTIMIZER_BYTES_PER_GRAD_BYTE = 7.0


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
    for f in NUMBERS:
        if not float(preset[f]) > 0:
            raise ValueError(f"--hardware {name}: {f} must be positive")
    try:
        network({"name": name, **preset})
    except ValueError as err:
        raise ValueError(f"--hardware {name}: {err}") from None
    if not float(preset["compute_fraction"]) <= 1:
        raise ValueError(f"--hardware {name}: compute_fraction is a fraction of the peak (0-1]")
    if not float(preset["overlap_slowdown"]) >= 0:
        raise ValueError(f"--hardware {name}: overlap_slowdown is how much longer compute takes beside NCCL (>= 0)")
    return {"name": name, **preset}


def network(preset: dict[str, Any]) -> nccl.Network:
    return nccl.Network(int(preset["gpus_per_node"]), float(preset["nvlink_busbw_gbps"]),
                        float(preset["nic_busbw_gbps"]), int(preset["nics_per_node"]), int(preset["channels"]),
                        str(preset["arch"]), str(preset["cpu"]), bool(preset.get("nvls", False)))


def allreduce_cost(preset: dict[str, Any], world_size: int) -> nccl.NCCLAllReduce:
    """bytes -> seconds of one all-reduce on this preset, as NCCL's tuner prices it."""
    return nccl.NCCLAllReduce(network(preset), world_size)


def collective_cost(preset: dict[str, Any], op: str, group: nccl.Group) -> Callable[[float], float]:
    """bytes (the collective's full buffer) -> seconds of ``op`` over ``group`` on this preset."""
    net = network(preset)
    nccl.communicator(net, group)  # a group that does not fit the preset's nodes fails here, not mid-search
    return partial(nccl.collective_seconds, net, op, group=group)


def compute_from_flops(preset: dict[str, Any], counted: flop_model.Flops) -> tuple[DDPProfile, Overheads]:
    """The compute of a counted workload on the preset's device (path 2 of the module docstring)."""
    hbm = float(preset["hbm_gbps"]) * 1e9
    rate = float(preset["peak_tflops"]) * 1e12 * float(preset["compute_fraction"])
    optimizer = OPTIMIZER_BYTES_PER_GRAD_BYTE * sum(counted.param_nbytes) / hbm
    # write-back: each reduced byte read from the bucket and written to .grad
    return flop_model.profile(counted, rate, optimizer_s=optimizer), Overheads(BUCKET_FIXED_S, 2.0 / hbm)


def system_on(preset: dict[str, Any], overheads: Overheads, world_size: int, algorithm: str = "native",
              shard: int | None = None) -> SystemCosts:
    """The machine's terms for one data-parallel world packed on whole nodes: its all-reduce,
    reduce-scatter and all-gather (keyed as the DDP and ZeRO lowerings read them), the device's
    overheads, and the preset's compute slowdown while NCCL's kernels share the SMs (``kc``;
    communication ASSUMED not slowed by compute: ``km`` 0). No co-run stretch (one GPU per rank).
    With ``shard`` (hybrid sharding) also the shard groups' collectives and the replicas' all-reduce
    (nccl.hybrid_groups)."""
    group = nccl.full_nodes(network(preset), world_size)
    collectives = {(key, algorithm, world_size): collective_cost(preset, op, group)
                   for key, op in (("allreduce", "all_reduce"), ("reduce_scatter", "reduce_scatter"),
                                   ("all_gather", "all_gather"))}
    if shard and shard != world_size:
        within, across = nccl.hybrid_groups(network(preset), world_size, shard)
        collectives.update({(op, algorithm, shard): collective_cost(preset, op, within)
                            for op in ("all_reduce", "reduce_scatter", "all_gather")})
        collectives[(REPLICATE_ALL_REDUCE, algorithm, world_size // shard)] = collective_cost(preset, "all_reduce", across)
    return SystemCosts(collectives=collectives, overheads=overheads,
                       contention={algorithm: Contention(kc=float(preset["overlap_slowdown"]))})


def assumptions(preset: dict[str, Any], compute: str) -> str:
    """What every figure on this preset rests on, in one paragraph."""
    nvls = "NVLS and NVLS-tree, " if preset.get("nvls") else ""
    return (f"collectives priced by NCCL's tuning model (2.20: ring or tree x LL, LL128, Simple, {nvls}the fastest; "
            f"no CollNet): {preset['nvlink_busbw_gbps']} GB/s bus bandwidth within {preset['gpus_per_node']} "
            f"GPUs, {preset['nics_per_node']} x {preset['nic_busbw_gbps']} GB/s NICs across nodes; {compute}; "
            f"compute {float(preset['overlap_slowdown']):.0%} slower while NCCL runs beside it, communication not "
            f"slowed; sources: {preset['source']}")


__getattr__ = renamed_getattr(__name__, {"flops_profile": "compute_from_flops"})  # the old name, for a release
