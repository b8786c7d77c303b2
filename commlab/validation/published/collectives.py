"""NCCL's tuner model against collective measurements others published (held out).

    python -c "from commlab.validation.published.collectives import rows, table; print(table(rows()))"

Each source in collectives.yaml names the cluster it ran on; the row is priced on THAT cluster: the
named preset with the fields the source states overridden (its NICs a node, its CPU), the group
placed as the run placed it (``per_node`` ranks on each node, one communicator). Nothing here
feeds back into the model: commlab/costmodel never reads this folder.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from commlab.costmodel.hardware import nccl
from commlab.costmodel.hardware.presets import load_preset, network

DATA = Path(__file__).with_name("collectives.yaml")
KEYS = ("table", "case", "metric", "published", "predicted", "error", "source")
METRICS = ("busbw GB/s", "average busbw GB/s", "time us")


def sources(path: Path = DATA) -> list[dict[str, Any]]:
    """The held-out sources, each checked for what pricing it needs."""
    data = yaml.safe_load(path.read_text())
    for src in data:
        missing = [k for k in ("table", "source", "cluster", "preset", "gpus", "per_node", "op", "metric")
                   if k not in src]
        if missing or src["metric"] not in METRICS or not ("sizes" in src) ^ ("value" in src):
            raise ValueError(f"{path}: a source needs {missing or 'sizes or one value'} and a metric of "
                             f"{METRICS}: {src.get('source')}")
    return data


def cluster_network(src: dict[str, Any]) -> nccl.Network:
    """The network the source ran on: its preset with the source's own figures in place."""
    return network({**load_preset(src["preset"]), **src.get("network", {})})


def predict(src: dict[str, Any], nbytes: float) -> float:
    """The model's figure for one size of a source, in the source's metric."""
    net, group = cluster_network(src), nccl.Group(int(src["gpus"]), int(src["per_node"]))
    if src["metric"] == "time us":
        return nccl.collective_seconds(net, src["op"], nbytes, group) * 1e6
    return nccl.bus_bandwidth(net, src["op"], nbytes, group)


def average_busbw(src: dict[str, Any]) -> float:
    """nccl-tests' "Avg bus bandwidth": the mean busbw over the run's sizes."""
    sweep = src["average_over"]
    sizes = [sweep["first"] + k * sweep["step"] for k in range(sweep["count"])]
    return sum(predict({**src, "metric": "busbw GB/s"}, s) for s in sizes) / len(sizes)


def _size(nbytes: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.4g} {unit}"
    return f"{nbytes} B"


def case(src: dict[str, Any], nbytes: int | None) -> str:
    """e.g. "24 A100, 3 nodes x 4 NICs, 128 MiB"."""
    net = cluster_network(src)
    device = load_preset(src["preset"])["device"]
    nodes = nccl.Group(int(src["gpus"]), int(src["per_node"])).nodes
    where = f"{nodes} nodes x {net.nics_per_node} NICs" if nodes > 1 else "1 node"
    what = _size(nbytes) if nbytes is not None else "mean of the sweep"
    return f"{src['gpus']} {device}, {where}, {what}"


def rows(path: Path = DATA) -> list[dict[str, Any]]:
    """One row per (source, size): published, predicted and predicted / published - 1."""
    out = []
    for src in sources(path):
        pairs = ([(None, float(src["value"]), average_busbw(src))] if "value" in src else
                 [(int(n), float(v), predict(src, int(n))) for n, v in src["sizes"]])
        for nbytes, published, predicted in pairs:
            out.append({"table": src["table"], "case": case(src, nbytes), "metric": src["metric"],
                        "published": published, "predicted": predicted, "error": predicted / published - 1,
                        "source": src["source"], "gpus": int(src["gpus"])})
    return [{k: r[k] for k in (*KEYS, "gpus")} for r in out]


def table(found: list[dict[str, Any]]) -> str:
    """The rows as an aligned text table."""
    lines = [f"{'case':<44} {'metric':<19} {'published':>9} {'predicted':>9} {'error':>7}  source"]
    for r in found:
        lines.append(f"{r['case']:<44} {r['metric']:<19} {r['published']:>9.2f} {r['predicted']:>9.2f} "
                     f"{r['error']:>+7.1%}  {r['source']}")
    return "\n".join(lines)
