"""Calibration: measure the model's terms once (commlab/costmodel/measure.py), cache them as a profile.

    entry = profile_for(workload, backend="gloo", world_size=2, path=PROFILE)   # cached or fresh

One launch at the calibrated world size does everything (see measure.py for what and why); it
never runs a multi-rank DDP iteration. The entry is keyed as commlab/costmodel/profile.py says.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from commlab.costmodel import profile as prof
from commlab.costmodel import uncertainty
from commlab.costmodel.costs import fit_table, solve_contention
from commlab.costmodel.measure_queue import paired_seconds

DEFAULT_PROFILE = Path.home() / ".cache" / "commlab" / "profile.json"
DEFAULT_ALGORITHMS = ("native", "ring")


@dataclass(frozen=True)
class Workload:
    """What a profile is measured for (the workload columns of a sweep configuration)."""

    model: str
    model_args: str  # canonical "key=value,..."
    batch_per_rank: int

    def kwargs(self) -> dict[str, Any]:
        from commlab.sweep.spec import parse_model_args

        return parse_model_args(self.model_args)


def default_threads(world_size: int) -> int:
    """What commlab.launch gives each local rank when OMP_NUM_THREADS is not set."""
    if os.environ.get("OMP_NUM_THREADS"):
        return int(os.environ["OMP_NUM_THREADS"])
    return max(1, (os.cpu_count() or 1) // world_size)


def parameter_sizes(workload: Workload) -> tuple[list[int], list[tuple[int, ...]]]:
    """Bytes and shapes of the trainable parameters, in module order (builds the model once)."""
    import torch

    from commlab.models import build_workload

    # On the meta device: shapes without allocating or initialising weights (seconds for big models).
    with torch.device("meta"):
        model = build_workload(workload.model, **workload.kwargs()).model
    params = [p for p in model.parameters() if p.requires_grad]
    return [p.numel() * p.element_size() for p in params], [tuple(p.shape) for p in params]


def table_sizes(total_bytes: int, smallest: int = 64 << 10, factor: int = 4) -> list[int]:
    """Bucket sizes that can occur: x4 steps from 64 KiB (less for a small model) up to and
    including the whole model; always at least two, so that the table has a slope."""
    smallest = max(min(smallest, total_bytes // factor), 4)
    sizes, size = [], smallest
    while size < total_bytes:
        sizes.append(size)
        size *= factor
    return sorted(set(sizes + [max(total_bytes, smallest * factor)]))


def calibrate(workload: Workload, *, backend: str, world_size: int, threads: int | None = None,
              algorithms: tuple[str, ...] = DEFAULT_ALGORITHMS, reps: int = 5, iters: int = 9,
              timeout: float = 300.0, echo: Callable[[str], None] = lambda _l: None,
              sharded: bool = False) -> dict[str, Any]:
    """Measure and return a profile entry (does not write it). ``sharded``: also the reduce-scatter
    and all-gather of every algorithm sharded data parallelism has (commlab/sharded/comm.py)."""
    import commlab

    threads = threads or default_threads(world_size)
    nbytes, shapes = parameter_sizes(workload)
    sizes = table_sizes(sum(nbytes))
    spec = {"model": workload.model, "model_kwargs": workload.kwargs(), "batch_per_rank": workload.batch_per_rank,
            "threads": threads, "algorithms": list(algorithms), "sizes": sizes, "iters": iters, "reps": reps,
            "warmup": 2, "sharded_algorithms": sharded_algorithms(world_size) if sharded else []}
    begin = time.monotonic()
    from commlab.costmodel.measure import calibrate_rank

    echo(f"calibrating {workload.model} ({sum(nbytes) / 2**20:.1f} MiB of gradients) on {backend}, "
         f"world size {world_size}, {threads} thread(s) per rank: {world_size} process(es), "
         "typically 15-50 s ...")
    load_before, running_before = os.getloadavg()[0], runnable_now()
    results = commlab.launch(calibrate_rank, spec, world_size=world_size, backend=backend, timeout=timeout)
    load_after = os.getloadavg()[0]
    entry = assemble(results, spec, nbytes, shapes,
                     prof.make_key(backend=backend, world_size=world_size, threads=threads, model=workload.model,
                                   model_args=workload.model_args, batch_per_rank=workload.batch_per_rank))
    entry["calibration_s"] = time.monotonic() - begin
    steadiness = uncertainty.judge(spread_of(results), load_before, load_after, cpus=os.cpu_count() or 1,
                                   own_threads=world_size * threads, seconds=entry["calibration_s"],
                                   running_before=running_before)
    entry["steadiness"] = steadiness.as_json()
    echo(f"calibrated in {entry['calibration_s']:.1f} s; {steadiness.describe()}")
    return entry


def runnable_now(samples: int = 10, every_s: float = 0.05) -> float | None:
    """Threads other than this one runnable right now (Linux /proc/loadavg's fourth field,
    averaged over ``samples``), or None where the kernel does not say."""
    counts = []
    for _ in range(samples):
        try:
            running = Path("/proc/loadavg").read_text().split()[3].split("/")[0]
        except (OSError, IndexError):
            return None
        counts.append(max(int(running) - 1, 0))
        time.sleep(every_s)
    return sum(counts) / len(counts)


def spread_of(results: list[dict]) -> float:
    """The calibration's spread (pure): over every repeated micro-benchmark of every rank (each
    all-reduce size of each algorithm, and rank 0's forward + backward inside DDP)."""
    series = [s for r in results for per_size in r.get("collective_samples", {}).values() for s in per_size]
    series.append(results[0]["ddp"].get("step_samples", []))
    return uncertainty.overall_spread(series)


def assemble(results: list[dict], spec: dict, nbytes: list[int], shapes: list, key: dict) -> dict[str, Any]:
    """Turn the ranks' raw measurements into a profile entry (pure)."""
    ddp = results[0]["ddp"]
    collectives = {}
    for algorithm in spec["algorithms"]:
        # The slowest rank's time: a collective ends for everyone when the last rank is through.
        seconds = [max(r["collectives"][algorithm][i] for r in results) for i in range(len(spec["sizes"]))]
        collectives[algorithm] = fit_table(spec["sizes"], seconds)
    contention = {}
    for algorithm, c in results[0]["contention"].items():
        kc, km = solve_contention(c["compute_alone_s"], c["comm_alone_s"], c["compute_both_s"], c["comm_both_s"])
        contention[algorithm] = {"kc": kc, "km": km, "raw": c}
        copy = results[0].get("copy_contention", {}).get(algorithm)
        if copy:  # the write-back's copies beside the collective (profiles before it lack it)
            kc_copy, km_copy = solve_contention(copy["compute_alone_s"], copy["comm_alone_s"],
                                                copy["compute_both_s"], copy["comm_both_s"])
            contention[algorithm].update(kc_copy=kc_copy, km_copy=km_copy, raw_copy=copy)
    concurrency = {}
    for algorithm in results[0].get("queue", {}):
        # The slowest rank's queue at each size: per collective while two run at once, a table of
        # its own; the gain of Gloo's two lanes where DDP queues its buckets (measure_queue.py).
        q = results[0]["queue"][algorithm]
        seconds = [max(r["queue"][algorithm]["queued_s"][i] for r in results) for i in range(len(q["sizes"]))]
        table = collectives[algorithm]
        table_s = [table["seconds"][table["sizes"].index(n)] for n in q["sizes"]]
        paired = paired_seconds(table_s, q["k"], seconds)
        # one number for lowerings that price one gain (the size nearest 8 MiB, as measured before)
        near = min(range(len(q["sizes"])), key=lambda i: abs(q["sizes"][i] - (8 << 20)))
        concurrency[algorithm] = {"lanes": 2, "gain": min(max(table_s[near] / paired[near], 0.5), 2.0),
                                  "sizes": q["sizes"], "paired_s": paired,
                                  "raw": {"k": q["k"], "queued_s": seconds, "table_s": table_s}}
    sharded = {}
    for collective in ("reduce_scatter", "all_gather") if spec.get("sharded_algorithms") else ():
        sharded[collective] = {a: fit_table(spec["sizes"], [max(r["sharded"][collective][a][i] for r in results)
                                                             for i in range(len(spec["sizes"]))])
                               for a in spec["sharded_algorithms"] if a in results[0]["sharded"][collective]}
    corun = results[0]["corun"]
    factor = corun["together_s"] / corun["alone_s"] if corun["alone_s"] > 0 and len(results) > 1 else 1.0
    return {
        "key": key,
        "created": time.time(),
        "params": {"nbytes": nbytes, "ready_order": ddp["ready_order"],
                   "signature": prof.param_signature(nbytes, shapes)},
        "compute": {"forward_s": ddp["forward_s"], "ready_s": ddp["ready_s"], "optimizer_s": ddp["optimizer_s"],
                    "nosync_s": ddp["nosync_s"], "writeback_s_per_byte": ddp["writeback_s_per_byte"],
                    "bucket_fixed_s": ddp["bucket_fixed_s"], "corun": max(factor, 1.0), "corun_raw": corun,
                    # pages first touched in the profiled forward+backward (fresh gradients)
                    "profiled_fresh_bytes": ddp.get("fresh_bytes", 0),
                    "profiled_at_world_size": 1, "ddp_runs": {"one_bucket_exposed_s": ddp["exposed_s"],
                                                              "many_buckets": ddp["small_run"]},
                    # where it was measured, and the CUDA caching allocator's state after (GPU only)
                    "device": results[0].get("device", "cpu"), "device_name": results[0].get("device_name", "cpu"),
                    "allocator": results[0].get("allocator", {}),
                    # what forward keeps for backward (sharded calibrations only): the predicted peak's
                    **({"activation_bytes": results[0]["activation_bytes"]} if "activation_bytes" in results[0] else {}),
                    # allocating a buffer anew (sharded calibrations only; the slowest rank's)
                    **({"fresh_memory": fit_table(spec["sizes"], [max(r["fresh_memory"][i] for r in results)
                                                                 for i in range(len(spec["sizes"]))])}
                       if "fresh_memory" in results[0] else {})},
        "contention": contention,
        "collectives": collectives,
        "concurrency": concurrency,
        **({"sharded_collectives": sharded} if sharded else {}),
    }


def sharded_algorithms(world_size: int) -> list[str]:
    """The algorithms with a reduce-scatter and an all-gather (commlab/sharded/comm.py); one that
    refuses this world size is dropped by the ranks (commlab/costmodel/measure_sharded.py)."""
    from commlab.sharded import comm  # lazy: it imports torch

    return list(comm.ALGORITHMS)


# Key fields a calibration is valid for besides the workload, in words (profile.make_key).
_SETTING = {"backend": "backend", "world_size": "world size", "threads": "threads per rank",
            "batch_per_rank": "batch per rank"}


def _not_covered_by(path: Path, key: dict) -> str:
    """Why the entries cached for the same model and sizes do not serve ``key`` ('' if none are)."""
    same = [e["key"] for e in prof.read_file(path).values() if isinstance(e, dict) and
            (e.get("key", {}).get("model"), e.get("key", {}).get("model_args")) == (key["model"], key["model_args"])]
    if not same:
        return ""
    held = "; ".join(f"{prof.key_id(k)}: " + ", ".join(f"{word} {k.get(f)}, not {key[f]}" for f, word in _SETTING.items()
                                                        if k.get(f) != key[f]) for k in same[:3])
    return f" (it holds {held}; a calibration serves one backend, world size, threads per rank and batch per rank)"


def profile_for(workload: Workload, *, backend: str, world_size: int, threads: int | None = None,
                path: Path = DEFAULT_PROFILE, recalibrate: bool = False, algorithms: tuple[str, ...] = DEFAULT_ALGORITHMS,
                max_age_s: float = prof.DEFAULT_MAX_AGE_S, echo: Callable[[str], None] = lambda _l: None,
                sharded: bool = False) -> dict:
    """The cached entry for this workload and setting, calibrating (and caching) when needed.

    Missing, stale (too old, model changed) or lacking an algorithm -> calibrate; broken or
    foreign (other machine, other torch) -> ProfileError, unless ``recalibrate``.
    """
    threads = threads or default_threads(world_size)
    key = prof.make_key(backend=backend, world_size=world_size, threads=threads, model=workload.model,
                        model_args=workload.model_args, batch_per_rank=workload.batch_per_rank)
    old = None
    if not recalibrate:
        nbytes, shapes = parameter_sizes(workload)
        try:
            entry = old = prof.lookup(path, key, signature=prof.param_signature(nbytes, shapes), max_age_s=max_age_s)
            missing = [a for a in algorithms if a not in entry["collectives"]]
            if sharded and "sharded_collectives" not in entry:
                missing.append("reduce-scatter/all-gather tables")
            if not missing:
                return entry
            echo(f"profile {prof.key_id(key)} lacks {', '.join(missing)} (calibrated for {', '.join(entry['collectives'])}; "
                 "`commlab calibrate` measures every algorithm, with --stage 1-3 the sharded tables too): recalibrating")
        except KeyError:
            echo(f"no calibration of {prof.key_id(key)} in {path}{_not_covered_by(path, key)}: calibrating")
        except prof.StaleProfile as stale:
            echo(f"{stale}: recalibrating")
    else:
        echo(f"--recalibrate: calibrating {prof.key_id(key)} again")
    entry = calibrate(workload, backend=backend, world_size=world_size, threads=threads, algorithms=algorithms, echo=echo,
                      sharded=sharded or "sharded_collectives" in (old or {}))
    prof.store(path, entry)
    return entry
