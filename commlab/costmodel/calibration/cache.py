"""The calibration cache: what one calibration measured, its key, and the file that caches it.

A calibration file is JSON (human-readable) holding any number of entries, one per key::

    {"format": 1, "entries": {"<key id>": {"key": {...}, "created": ..., "compute": {...}, ...}}}

The key says what the numbers are valid for: the machine, the backend, the world size, the
threads per rank, the workload (model, sizes, per-rank batch, the optimizer whose step was
profiled) and the torch version. Loading
checks an entry before anything runs: a missing field is an error; an entry made on another
machine or torch version is an error (its numbers describe other hardware or other kernels);
an entry older than ``max_age_s``, or whose workload's parameter shapes changed, is *stale* and
is recalibrated rather than silently used (this machine's speed drifts 20-30% over minutes,
so calibration belongs just before the prediction).
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import time
from pathlib import Path
from typing import Any

from commlab._atomic import write_text
from commlab._lazy import renamed_getattr
from commlab.runs.optimizers import DEFAULT as DEFAULT_OPTIMIZER

FORMAT = 1
DEFAULT_MAX_AGE_S = 3600.0
# Every field an entry must have, with the sub-fields that the lowering reads.
REQUIRED = {
    "key": ("machine", "backend", "world_size", "threads", "model", "model_args", "batch_per_rank", "torch"),
    "created": (),
    "params": ("nbytes", "ready_order", "signature"),
    "compute": ("forward_s", "ready_s", "optimizer_s", "nosync_s", "writeback_s_per_byte", "bucket_fixed_s", "corun"),
    "contention": (),
    "collectives": (),
}


class CalibrationError(ValueError):
    """A calibration that cannot be used: missing fields, another machine or torch version."""


class StaleCalibration(Exception):
    """A calibration entry that exists but must be redone (too old, or the workload changed)."""


def machine_id() -> str:
    """Host name, CPU model and core count: what makes timings comparable between runs."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{platform.node()}|{cpu}|{os.cpu_count()}"


def make_key(*, backend: str, world_size: int, threads: int, model: str, model_args: str, batch_per_rank: int,
             optimizer: str = DEFAULT_OPTIMIZER) -> dict[str, Any]:
    """The key of a calibration. The optimizer whose step it profiled is part of it (Adam's step
    streams three times SGD's bytes): left out for plain SGD, so that entries made before it
    was keyed keep their ids, and an SGD entry is never found for Adam."""
    import torch

    key = {"machine": machine_id(), "backend": backend, "world_size": int(world_size), "threads": int(threads),
           "model": model, "model_args": model_args, "batch_per_rank": int(batch_per_rank), "torch": torch.__version__}
    return key if optimizer == DEFAULT_OPTIMIZER else {**key, "optimizer": optimizer}


def key_optimizer(key: dict[str, Any]) -> str:
    """The optimizer a calibration profiled (an entry keyed without one: plain SGD)."""
    return key.get("optimizer", DEFAULT_OPTIMIZER)


def key_id(key: dict[str, Any]) -> str:
    """Readable and stable: model, backend, world size, threads, batch, the optimizer unless plain
    SGD, then a short digest."""
    digest = hashlib.sha1(json.dumps(key, sort_keys=True).encode()).hexdigest()[:8]
    model = "".join(c if c.isalnum() else "_" for c in key["model"])[:24]
    optimizer = "" if key_optimizer(key) == DEFAULT_OPTIMIZER else f"-{key_optimizer(key)}"
    return f"{model}-{key['backend']}-w{key['world_size']}-t{key['threads']}-bs{key['batch_per_rank']}{optimizer}-{digest}"


def check_entry(entry: Any, where: str = "calibration") -> None:
    """CalibrationError naming the first missing field."""
    if not isinstance(entry, dict):
        raise CalibrationError(f"{where}: an entry must be a JSON object")
    for field, subs in REQUIRED.items():
        if field not in entry:
            raise CalibrationError(f"{where}: missing field {field!r} (recalibrate with --recalibrate)")
        for sub in subs:
            if sub not in entry[field]:
                raise CalibrationError(f"{where}: missing field {field}.{sub} (recalibrate with --recalibrate)")


def read_file(path: Path) -> dict[str, dict]:
    """All entries of a calibration file ({} when it does not exist); CalibrationError when unreadable."""
    path = Path(path)
    if not path.exists():
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise CalibrationError(f"{path}: not a readable calibration file ({err})") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT or not isinstance(data.get("entries"), dict):
        raise CalibrationError(f"{path}: not a commlab calibration file of format {FORMAT} (delete it or pass another --calibration)")
    return data["entries"]


def lookup(path: Path, key: dict[str, Any], *, signature: str | None = None,
           max_age_s: float = DEFAULT_MAX_AGE_S, now: float | None = None) -> dict:
    """The entry for ``key``; KeyError when absent, StaleCalibration when it must be redone,
    CalibrationError when it is broken or foreign."""
    entries = read_file(path)
    entry = entries.get(key_id(key))
    if entry is None:
        # An entry for the same workload made elsewhere is an error, not a miss: say so.
        for other in entries.values():
            k = other.get("key", {}) if isinstance(other, dict) else {}
            same = all(k.get(f) == key[f] for f in key if f not in ("machine", "torch")) \
                and key_optimizer(k) == key_optimizer(key)
            if same and k.get("machine") != key["machine"]:
                raise CalibrationError(f"{path}: calibration was made on another machine ({k.get('machine')!r}, "
                                   f"this is {key['machine']!r}); pass --recalibrate or another --calibration")
            if same and k.get("torch") != key["torch"]:
                raise CalibrationError(f"{path}: calibration was made with torch {k.get('torch')}, this is torch "
                                   f"{key['torch']}; pass --recalibrate or another --calibration")
        raise KeyError(key_id(key))
    check_entry(entry, f"{path} [{key_id(key)}]")
    age = (time.time() if now is None else now) - float(entry["created"])
    if age > max_age_s:
        raise StaleCalibration(f"calibration {key_id(key)} is {age / 60:.0f} min old (limit {max_age_s / 60:.0f} min)")
    if "steadiness" not in entry:
        raise StaleCalibration(f"calibration {key_id(key)} was made before calibration judged its own steadiness")
    if signature is not None and entry["params"]["signature"] != signature:
        raise StaleCalibration(f"calibration {key_id(key)}: the model's parameters changed since calibration")
    return entry


def store(path: Path, entry: dict) -> None:
    """Add or replace one entry (atomically rewriting the file)."""
    check_entry(entry)
    path = Path(path)
    entries = read_file(path) if path.exists() else {}
    entries[key_id(entry["key"])] = entry
    write_text(path, json.dumps({"format": FORMAT, "entries": entries}, indent=1, sort_keys=True) + "\n")


def param_signature(nbytes: list[int], shapes: list[tuple[int, ...]]) -> str:
    return hashlib.sha1(json.dumps([nbytes, [list(s) for s in shapes]]).encode()).hexdigest()[:12]


__getattr__ = renamed_getattr(__name__, {"ProfileError": "CalibrationError", "StaleProfile": "StaleCalibration"})
