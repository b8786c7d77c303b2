"""`commlab bench ddp`: commlab's DDP against torch's DDP, alternating iterations in one launch.

Both wrap copies of the same model, see the same batches and use the same bucket cap; iteration i
of one is followed by iteration i of the other, so a load change on a shared machine hits both.
An iteration is forward + backward (gradients synchronised) + an SGD step; its time is the
slowest rank's. The command prints each median and the ratio commlab / torch, in wall time and
in process CPU time (steadier on a busy machine), and beside them each implementation's spread
(p10 / median / p90) and its minor page faults per iteration (on CUDA: cudaMalloc calls of the
caching allocator), so a run that touches fresh memory shows up instead of being averaged away:

    commlab bench ddp                                  # 12 x 1024 MLP, gloo, world 2, 25 MB
    commlab bench ddp --bucket-mb 5 --algorithm ring   # another cap, commlab's ring all-reduce
    commlab bench ddp --glibc-trim                     # glibc's own heap trimming (see below)

The options are declared in :mod:`commlab.cli.bench`; this module is the run.
"""

from __future__ import annotations

import functools
import itertools
import json
import os
import resource
import statistics
import time

import click

import commlab
from commlab._atomic import write_text
from commlab._malloc import keep_freed_memory
from commlab.runtime.interrupt import keep_partial
from commlab.runtime.orphans import private_tempdir
from commlab.runtime.timer import Counter, WallClock, timed_rounds


def _bench_rank(cfg: dict) -> dict:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    import commlab
    from commlab.models import build_workload

    rt = commlab.Runtime.current()
    kept = keep_freed_memory() if cfg.get("keep_freed", False) else False
    torch.manual_seed(0)
    sizes = {"depth": cfg["depth"], "width": cfg["width"]} if cfg["model"] == "mlp" else {}
    work = build_workload(cfg["model"], **sizes)
    models = {
        "commlab": commlab.DistributedDataParallel(
            work.model.to(rt.device), bucket_cap_mb=cfg["bucket_mb"], algorithm=cfg["algorithm"]
        ),
        "torch": TorchDDP(build_workload(cfg["model"], **sizes).model.to(rt.device), bucket_cap_mb=cfg["bucket_mb"]),
    }
    opts = {name: torch.optim.SGD(m.parameters(), lr=1e-4) for name, m in models.items()}
    gen = torch.Generator().manual_seed(1 + rt.rank)
    batches = [work.make_batch(cfg["batch"], gen) for _ in range(4)]
    batches = [(x.to(rt.device), y.to(rt.device)) for x, y in batches]
    feeds = {name: itertools.cycle(batches) for name in models}  # round i: batch i of the cycle, both

    def step(name: str) -> None:
        x, y = next(feeds[name])
        opts[name].zero_grad()
        work.loss_fn(models[name](x), y).backward()
        opts[name].step()

    facts = {"params": sum(p.numel() for p in work.model.parameters()), "cuda": rt.device.type == "cuda", "kept": kept,
             "buckets": len(models["commlab"].bucket_sizes)}

    def save(round_: int, samples: dict) -> None:  # untimed: what an interrupted run reports
        if cfg.get("partial_dir") and round_ >= cfg["warmup"]:
            write_text(os.path.join(cfg["partial_dir"], f"rank{rt.rank}.json"), json.dumps({**samples, **facts}))

    # Iterations alternate between the two (neither always goes first), each from a barrier.
    samples = timed_rounds({name: functools.partial(step, name) for name in models}, cfg["iters"], cfg["warmup"],
                           meters={"times": WallClock(rt.device), "cpu": Counter(time.process_time),
                                   "faults": Counter(fresh_memory_counter(rt.device))},
                           before=lambda _name: dist.barrier(), after_round=save)
    return {**samples, **facts}


def fresh_memory_counter(device):
    """A counter of fresh memory taken from the system: on CPU the process's minor page faults
    (every thread's: the comm worker's too), on CUDA the caching allocator's cudaMalloc calls
    (``segment.all.allocated``), which stay flat once its pool serves every request."""
    import torch

    if device.type == "cuda":
        return lambda: torch.cuda.memory_stats(device).get("segment.all.allocated", 0)
    return lambda: resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def spread(values: list[float]) -> tuple[float, float, float]:
    """(p10, median, p90), linearly interpolated between order statistics."""
    xs = sorted(values)

    def at(q: float) -> float:
        k = q * (len(xs) - 1)
        lo = int(k)
        hi = min(lo + 1, len(xs) - 1)
        return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)

    return at(0.1), at(0.5), at(0.9)


def summarise(per_rank: list[dict], key: str = "times") -> dict:
    """Per iteration the slowest rank's time; then medians, their ratio, and the paired ratio.

    ``key="cpu"`` does the same with each rank's process CPU time (all its threads), which a
    loaded machine disturbs far less than wall time: it shows the reducer's own overhead.
    ``key="faults"``: per iteration the rank with the most. ``spread`` holds each
    implementation's (p10, median, p90) and ``max`` its largest iteration.
    """
    names = ("commlab", "torch")
    slowest = {name: [max(ts) for ts in zip(*(r[key][name] for r in per_rank))] for name in names}
    ours, theirs = statistics.median(slowest["commlab"]), statistics.median(slowest["torch"])
    pairs = list(zip(slowest["commlab"], slowest["torch"]))
    paired = statistics.median(a / b for a, b in pairs) if all(b for _, b in pairs) else float("nan")
    return {
        "commlab": ours,
        "torch": theirs,
        "ratio": ours / theirs if theirs else float("nan"),
        "paired_ratio": paired,
        "spread": {name: spread(slowest[name]) for name in names},
        "max": {name: max(slowest[name]) for name in names},
    }


def run(cfg: dict, *, world_size: int, backend: str, timeout: float) -> None:
    """Launch :func:`_bench_rank` on ``world_size`` ranks and print the comparison (options checked
    by the CLI). Interrupted, it prints the comparison of the iterations every rank finished."""
    with private_tempdir("commlab-ddp-bench-") as partial_dir:
        def save_partial() -> str | None:
            files = [os.path.join(partial_dir, f"rank{r}.json") for r in range(world_size)]
            if not all(os.path.exists(f) for f in files):
                return None
            per_rank = [json.loads(open(f).read()) for f in files]
            done = min(len(r["times"][name]) for r in per_rank for name in r["times"])
            for r in per_rank:  # the iterations every rank finished
                for key in ("times", "cpu", "faults"):
                    r[key] = {name: values[:done] for name, values in r[key].items()}
            _report(per_rank, {**cfg, "iters": done}, world_size, backend)
            return f"the table above ({done} of {cfg['iters']} timed iterations)"

        with keep_partial(save_partial):
            per_rank = commlab.launch(_bench_rank, {**cfg, "partial_dir": partial_dir}, world_size=world_size,
                                      backend=backend, timeout=timeout)
    _report(per_rank, cfg, world_size, backend)


def _report(per_rank: list[dict], cfg: dict, world_size: int, backend: str) -> None:
    model, depth, width, batch = cfg["model"], cfg["depth"], cfg["width"], cfg["batch"]
    bucket_mb, iters, warmup, algorithm = cfg["bucket_mb"], cfg["iters"], cfg["warmup"], cfg["algorithm"]
    s, c, f = summarise(per_rank), summarise(per_rank, "cpu"), summarise(per_rank, "faults")
    shape = f" ({depth} x {width})" if model == "mlp" else ""
    click.echo(
        f"model {model}{shape}, {per_rank[0]['params'] / 1e6:.1f} M params, batch {batch}/rank, "
        f"world {world_size}, {backend}, {bucket_mb:g} MiB buckets ({per_rank[0]['buckets']} in commlab), "
        f"all-reduce {algorithm}"
    )
    click.echo(f"{iters} timed iterations each after {warmup} warm-up, alternating; slowest rank per iteration")
    heap = "fixed glibc trim/mmap thresholds" if per_rank[0]["kept"] else "the allocator's default heap trimming"
    click.echo(f"memory: {heap}")
    fresh = "cudaMalloc/iter" if per_rank[0].get("cuda") else "minor faults/iter"
    click.echo(f"               wall ms/iter   cpu ms/iter   wall p10 / median / p90 ms   {fresh} median / p90 / max")
    for name, label in (("commlab", "commlab DDP"), ("torch", "torch DDP  ")):
        p10, med, p90 = (v * 1e3 for v in s["spread"][name])
        f10, fmed, f90 = f["spread"][name]
        click.echo(
            f"  {label}  {s[name] * 1e3:12.2f}  {c[name] * 1e3:12.2f}   {p10:8.2f} / {med:8.2f} / {p90:8.2f}"
            f"   {fmed:10.0f} / {f90:8.0f} / {f['max'][name]:8.0f}"
        )
    click.echo(f"  ratio commlab/torch: {s['ratio']:.3f} (median of per-iteration ratios {s['paired_ratio']:.3f})")
    click.echo(f"  cpu-time ratio:      {c['ratio']:.3f} (median of per-iteration ratios {c['paired_ratio']:.3f})")
