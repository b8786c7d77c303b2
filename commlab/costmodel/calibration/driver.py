"""Calibration: measure the model's terms once (commlab/costmodel/calibration/measure.py), and cache them.

    entry = calibration_for(workload, backend="gloo", world_size=2, path=FILE)   # cached or fresh

One launch at the calibrated world size does everything (see measure.py for what and why); it
never runs a multi-rank DDP iteration. The launch, its threads and its steadiness are every
calibration's (commlab/costmodel/calibration/run.py); the entry is keyed as
commlab/costmodel/calibration/cache.py says.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from commlab.costmodel.calibration import cache
from commlab.costmodel.terms import uncertainty
from commlab.costmodel.terms.costs import fit_table, solve_contention
from commlab.costmodel.calibration.queueing import paired_seconds
from commlab.costmodel.calibration.run import run_calibration
from commlab.runtime.threads import threads_per_rank
from commlab._lazy import renamed_getattr

# A cache: an entry more than an hour old is measured again anyway (cache.DEFAULT_MAX_AGE_S).
DEFAULT_CALIBRATION = Path.home() / ".cache" / "commlab" / "calibration.json"
DEFAULT_ALGORITHMS = ("native", "ring")


@dataclass(frozen=True)
class Workload:
    """What a calibration is measured for (the workload columns of a sweep configuration)."""

    model: str
    model_args: str  # canonical "key=value,..."
    batch_per_rank: int
    optimizer: str = "sgd"  # whose step is profiled (commlab/runs/optimizers.py); part of the key

    def kwargs(self) -> dict[str, Any]:
        from commlab.runs.options import parse_model_args

        return parse_model_args(self.model_args)


def default_threads(world_size: int) -> int:
    """What commlab.launch gives each local rank (commlab/runtime/threads.py's rule)."""
    return threads_per_rank(world_size)


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
    """Measure and return a calibration entry (does not write it). ``sharded``: also the reduce-scatter
    and all-gather of every algorithm sharded data parallelism has (commlab/sharded/comm.py)."""
    from commlab.costmodel.calibration.measure import calibrate_rank  # torch: loaded when calibrating

    threads = threads or default_threads(world_size)
    nbytes, shapes = parameter_sizes(workload)
    sizes = table_sizes(sum(nbytes))
    spec = {"model": workload.model, "model_kwargs": workload.kwargs(), "batch_per_rank": workload.batch_per_rank,
            "optimizer": workload.optimizer, "threads": threads, "algorithms": list(algorithms), "sizes": sizes, "iters": iters, "reps": reps,
            "warmup": 2, "sharded_algorithms": sharded_algorithms(world_size) if sharded else []}
    echo(f"calibrating {workload.model} ({sum(nbytes) / 2**20:.1f} MiB of gradients) on {backend}, "
         f"world size {world_size}, {threads} thread(s) per rank: {world_size} process(es), "
         "typically 15-50 s ...")
    run = run_calibration(calibrate_rank, spec, world_size=world_size, backend=backend, timeout=timeout,
                          spread=spread_of, threads=threads)
    entry = assemble(run.results, spec, nbytes, shapes,
                     workload_key(workload, backend, world_size, threads))
    entry["calibration_s"] = run.seconds
    entry["steadiness"] = run.steadiness.as_json()
    echo(f"calibrated in {entry['calibration_s']:.1f} s; {run.steadiness.describe()}")
    return entry


def workload_key(workload: Workload, backend: str, world_size: int, threads: int) -> dict[str, Any]:
    """The cache key of ``workload``'s calibration (commlab/costmodel/calibration/cache.py)."""
    return cache.make_key(backend=backend, world_size=world_size, threads=threads, model=workload.model,
                          model_args=workload.model_args, batch_per_rank=workload.batch_per_rank,
                          optimizer=workload.optimizer)


def spread_of(results: list[dict]) -> float:
    """The calibration's spread (pure): over every repeated micro-benchmark of every rank (each
    all-reduce size of each algorithm, and rank 0's forward + backward inside DDP)."""
    series = [s for r in results for per_size in r.get("collective_samples", {}).values() for s in per_size]
    series.append(results[0]["ddp"].get("step_samples", []))
    return uncertainty.overall_spread(series)


def assemble(results: list[dict], spec: dict, nbytes: list[int], shapes: list, key: dict) -> dict[str, Any]:
    """Turn the ranks' raw measurements into a calibration entry (pure)."""
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
        if copy:  # the write-back's copies beside the collective (calibrations before it lack it)
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
    # hybrid sharding's tables, per shard group size (each group's slowest rank: the max over all)
    hybrid = {size: {kind: {a: fit_table(spec["sizes"], [max(r["hybrid"][size][kind][a][i] for r in results)
                                                         for i in range(len(spec["sizes"]))])
                            for a in by_algorithm}
                     for kind, by_algorithm in kinds.items()}
              for size, kinds in (results[0].get("hybrid") or {}).items()}
    # Every rank ran its own DDP loop while rank 0 profiled (measure.py, step 1): the profile is
    # already what a rank takes beside the others, so nothing is stretched again. The lowering keeps
    # its co-run factors for costs from elsewhere (hardware presets, entries made before).
    corun = {"corun": 1.0, "corun_optimizer": 1.0, "corun_copy": 1.0}
    return {
        "key": key,
        "created": time.time(),
        "params": {"nbytes": nbytes, "ready_order": ddp["ready_order"],
                   "signature": cache.param_signature(nbytes, shapes),
                   # dim 0 of each: the sharded wrapper pads every parameter's rows to the world size
                   "rows": [s[0] if s else 1 for s in shapes]},
        "compute": {"forward_s": ddp["forward_s"], "ready_s": ddp["ready_s"], "optimizer_s": ddp["optimizer_s"],
                    "nosync_s": ddp["nosync_s"], "writeback_s_per_byte": ddp["writeback_s_per_byte"],
                    "bucket_fixed_s": ddp["bucket_fixed_s"], **corun,
                    # pages first touched in the profiled forward+backward: a record (the
                    # gradients over glibc's mmap threshold, every step and every layout alike)
                    "profiled_fresh_bytes": ddp.get("fresh_bytes", 0),
                    "profiled_at_world_size": 1, "profiled_beside_ranks": len(results), "ddp_runs": {"one_bucket_exposed_s": ddp["exposed_s"],
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
        **({"hybrid_collectives": hybrid} if hybrid else {}),
    }


def sharded_algorithms(world_size: int) -> list[str]:
    """The algorithms with a reduce-scatter and an all-gather (commlab/sharded/comm.py); one that
    refuses this world size is dropped by the ranks (commlab/costmodel/calibration/sharded.py)."""
    from commlab.sharded import comm  # lazy: it imports torch

    return list(comm.ALGORITHMS)


def _hybrid_possible(world_size: int) -> bool:
    from commlab.costmodel.calibration.sharded import shard_sizes  # lazy: it imports torch

    return bool(shard_sizes(world_size))


# Key fields a calibration is valid for besides the workload, in words (cache.make_key).
_SETTING = {"backend": "backend", "world_size": "world size", "threads": "threads per rank",
            "batch_per_rank": "batch per rank"}


def _not_covered_by(path: Path, key: dict) -> str:
    """Why the entries cached for the same model and sizes do not serve ``key`` ('' if none are)."""
    same = [e["key"] for e in cache.read_file(path).values() if isinstance(e, dict) and
            (e.get("key", {}).get("model"), e.get("key", {}).get("model_args")) == (key["model"], key["model_args"])]
    if not same:
        return ""
    def setting(k: dict) -> dict:
        return {**{f: k.get(f) for f in _SETTING}, "optimizer": cache.key_optimizer(k)}

    want = setting(key)
    held = "; ".join(f"{cache.key_id(k)}: " + ", ".join(f"{_SETTING.get(f, f)} {v}, not {want[f]}" for f, v in setting(k).items()
                                                         if v != want[f]) for k in same[:3])
    return (f" (it holds {held}; a calibration serves one backend, world size, threads per rank, batch per rank "
            "and optimizer)")


def calibration_for(workload: Workload, *, backend: str, world_size: int, threads: int | None = None,
                    path: Path = DEFAULT_CALIBRATION, recalibrate: bool = False,
                    algorithms: tuple[str, ...] = DEFAULT_ALGORITHMS, max_age_s: float = cache.DEFAULT_MAX_AGE_S,
                    echo: Callable[[str], None] = lambda _l: None, sharded: bool = False) -> dict:
    """The cached entry for this workload and setting, calibrating (and caching) when needed.

    Missing, stale (too old, model changed) or lacking an algorithm -> calibrate; broken or
    foreign (other machine, other torch) -> CalibrationError, unless ``recalibrate``.
    """
    threads = threads or default_threads(world_size)
    key = workload_key(workload, backend, world_size, threads)
    old = None
    if not recalibrate:
        nbytes, shapes = parameter_sizes(workload)
        try:
            entry = old = cache.lookup(path, key, signature=cache.param_signature(nbytes, shapes), max_age_s=max_age_s)
            missing = [a for a in algorithms if a not in entry["collectives"]]
            if sharded and "sharded_collectives" not in entry:
                missing.append("reduce-scatter/all-gather tables")
            elif sharded and "hybrid_collectives" not in entry and _hybrid_possible(world_size):
                missing.append("hybrid-sharding tables")
            if not missing:
                return entry
            echo(f"calibration {cache.key_id(key)} lacks {', '.join(missing)} (calibrated for {', '.join(entry['collectives'])}; "
                 "`commlab calibrate` measures every algorithm, with --stage 1-3 the sharded tables too): recalibrating")
        except KeyError:
            echo(f"no calibration of {cache.key_id(key)} in {path}{_not_covered_by(path, key)}: calibrating")
        except cache.StaleCalibration as stale:
            echo(f"{stale}: recalibrating")
    else:
        echo(f"--recalibrate: calibrating {cache.key_id(key)} again")
    entry = calibrate(workload, backend=backend, world_size=world_size, threads=threads, algorithms=algorithms, echo=echo,
                      sharded=sharded or "sharded_collectives" in (old or {}))
    cache.store(path, entry)
    return entry


__getattr__ = renamed_getattr(__name__, {"DEFAULT_PROFILE": "DEFAULT_CALIBRATION", "profile_for": "calibration_for"})
