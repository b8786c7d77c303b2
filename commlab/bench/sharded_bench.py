"""`commlab bench sharded`: commlab's sharded data parallelism against torch's, in alternating launches.

Each comparison (``--compare``) is a row: commlab's side and the side it is measured against, on
the same MLP, the same batches and an SGD step. Rows, printed in this order (like-for-like first):

- ``ring`` (the headline): commlab's stage 3 and torch's ``fully_shard`` (FSDP2) both on commlab's
  ring reduce-scatter and all-gather (fully_shard's through ``set_custom_reduce_scatter`` /
  ``set_custom_all_gather``, commlab/bench/fsdp_comms.py), so the ratio measures the sharding
  engines, not the collectives;
- ``native``: both on Gloo's own collectives (commlab ``algorithm="native"``: Gloo's list
  reduce-scatter; fully_shard as is: Gloo's flat ``reduce_scatter_single``, which is an all-reduce
  of the whole buffer, commlab/sharded/comm.py ``resolve_algorithm``);
- ``fully_shard``: commlab as a user gets it (``--algorithm``, default ``auto``: the ring on Gloo;
  ``--prefetch``) against fully_shard as is (Gloo's);
- ``ddp`` (on request): commlab's stage 2 against commlab's DistributedDataParallel, the same
  bucket cap (stage 2 moves the bytes DDP's all-reduce moves, as a reduce-scatter plus an all-gather).

Overlap. fully_shard on CPU overlaps nothing: it issues its reduce-scatter blocking, and its
implicit prefetch relies on device streams, which CPU tensors lack, so each all-gather blocks the
training thread too. commlab overlaps on its own: ring collectives run on the group's worker
thread, Gloo's asynchronously on Gloo's; a unit's all-gather runs ahead of use by ``prefetch``
units, and a unit's reduce-scatter overlaps the next unit's backward (one in flight; the engine has
no switch to make it blocking). The like-for-like rows run commlab with prefetch 0, so that the
all-gathers block as fully_shard's do; the reduce-scatter overlap remains, and the row says so.

Every implementation runs in a launch of its own (fresh processes, a fresh process group), and
launches alternate (A B, then B A, ...): two models in one process share one heap, and whichever
allocates second page-faults into memory the first one freed, which would decide the ratio (see
:func:`commlab.bench.ddp_bench.keep_freed_memory`). A launch times ``iters`` steps (zero_grad,
forward, backward, step) after ``warmup``, back to back (no barrier between them);
a step's time is the slowest rank's, and a launch gives its median. The command prints, per
side, the median over launches of those medians, and per row their ratio with
the spread of the per-launch ratios (launch i of one against launch i of the other: p10 /
median / p90 and min-max), in wall time and in process CPU time (steadier on a busy machine):

    commlab bench sharded                                  # the three rows, 8 x 1024 MLP, 6 launches each
    commlab bench sharded --compare ring --launches 10 --no-reshard
    commlab bench sharded --compare ddp --algorithm ring   # commlab's ring collectives in both
    commlab bench sharded --depth 4 --width 2048 --batch 8

The options are declared in :mod:`commlab.cli.bench`; this module is the run.
"""

from __future__ import annotations

import itertools
import statistics
import time

import click

import commlab
from commlab.runtime.interrupt import keep_partial
from commlab.bench.ddp_bench import fresh_memory_counter, keep_freed_memory, spread
from commlab.runtime.timer import Counter, CpuClock, timed_rounds

# implementation -> its label in the table
LABELS = {
    "stage3": "commlab stage 3",
    "fully_shard": "torch fully_shard",
    "stage2": "commlab stage 2",
    "ddp": "commlab DDP",
}
# --compare name -> (commlab's side, the side it is measured against); a side is an implementation
# and what it overrides of the options (the collectives, commlab's prefetch). Like-for-like first.
COMPARISONS = {
    "ring": (("stage3", {"algorithm": "ring", "prefetch": 0}), ("fully_shard", {"algorithm": "ring"})),
    "native": (("stage3", {"algorithm": "native", "prefetch": 0}), ("fully_shard", {"algorithm": "native"})),
    "fully_shard": (("stage3", {}), ("fully_shard", {"algorithm": "native"})),
    "ddp": (("stage2", {}), ("ddp", {})),
}
HEADLINE = "ring"
DEFAULT = ("ring", "native", "fully_shard")


def side_cfg(cfg: dict, side: tuple[str, dict]) -> dict:
    impl, overrides = side
    return {**cfg, **overrides, "impl": impl}


def runs(cfg: dict, backend: str = "gloo") -> str:
    """What one side runs: its collectives and what they overlap (this module's docstring)."""
    from commlab.sharded.comm import resolve_algorithm  # torch: not for the CLI's checks

    impl, algorithm = cfg["impl"], cfg["algorithm"]
    if impl == "fully_shard":
        comms = ("commlab's ring reduce-scatter and all-gather (set_custom_*)" if algorithm == "ring"
                 else "Gloo's reduce_scatter_single (an all-reduce) and all_gather_single")
        return f"{comms}, each blocking the training thread (no overlap on CPU)"
    if impl == "ddp":
        algorithm = "native" if algorithm == "auto" else algorithm
        comms = "Gloo's all-reduce" if algorithm == "native" else f"commlab's {algorithm} all-reduce"
        return f"{comms} per bucket, overlapping the rest of backward"
    algorithm = resolve_algorithm(algorithm, backend)
    comms = ("Gloo's list reduce-scatter and all_gather_single, on Gloo's thread" if algorithm == "native"
             else f"commlab's {algorithm} reduce-scatter and all-gather, on its comm worker thread")
    if impl == "stage2":
        return f"{comms}; reduce-scatters overlap backward, all-gathers the next forward"
    gathers = (f"all-gathers run {cfg['prefetch']} unit(s) ahead" if cfg["prefetch"]
               else "all-gathers block (prefetch 0)")
    return f"{comms}; {gathers}, a reduce-scatter overlaps the next unit's backward"


def wrap(impl: str, model, cfg: dict):
    """``model`` wrapped by ``impl``; units (stage 3 and fully_shard) are its Linear layers; fully_shard
    runs Gloo's collectives for ``algorithm="native"``, else commlab's (commlab/bench/fsdp_comms.py)."""
    import torch  # torch and what imports it: in the ranks only, so the CLI answers without them

    from commlab.sharded import ShardedDataParallel
    from commlab.sharded.comm import resolve_algorithm

    units = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    if impl == "stage3":
        return ShardedDataParallel(model, stage=3, units=units, prefetch=cfg["prefetch"],
                                   reshard_after_forward=cfg["reshard"], algorithm=cfg["algorithm"])
    if impl == "stage2":
        return ShardedDataParallel(model, stage=2, bucket_cap_mb=cfg["bucket_mb"], algorithm=cfg["algorithm"])
    if impl == "ddp":  # DDP's own default for "auto": the backend's all-reduce
        algorithm = "native" if cfg["algorithm"] == "auto" else cfg["algorithm"]
        return commlab.DistributedDataParallel(model, bucket_cap_mb=cfg["bucket_mb"], algorithm=algorithm)
    if impl == "fully_shard":
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for unit in units:
            fully_shard(unit, mesh=mesh, reshard_after_forward=cfg["reshard"])
        root = fully_shard(model, mesh=mesh, reshard_after_forward=cfg["reshard"])
        if cfg["algorithm"] != "native":  # commlab's p2p collectives in place of Gloo's
            from commlab.bench.fsdp_comms import use_p2p_collectives

            use_p2p_collectives(root, resolve_algorithm(cfg["algorithm"], "gloo"))
        return root
    raise ValueError(f"unknown implementation {impl!r}: choose from {', '.join(LABELS)}")


def _bench_rank(cfg: dict) -> dict:
    """One launch of one implementation: per timed step its wall time, CPU time and fresh memory."""
    import torch
    import torch.distributed as dist

    from commlab.models import build_workload

    rt = commlab.Runtime.current()
    kept = keep_freed_memory() if cfg["keep_freed"] else False
    torch.manual_seed(0)  # fully_shard does not broadcast: every rank builds the same values
    work = build_workload("mlp", depth=cfg["depth"], width=cfg["width"])
    params = sum(p.numel() for p in work.model.parameters())
    model = wrap(cfg["impl"], work.model, cfg)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    gen = torch.Generator().manual_seed(1 + rt.rank)
    feed = itertools.cycle([work.make_batch(cfg["batch"], gen) for _ in range(4)])

    def step() -> None:
        x, y = next(feed)
        opt.zero_grad()
        work.loss_fn(model(x), y).backward()
        opt.step()

    # One barrier before the first step and none between steps: work that an implementation leaves
    # in flight after its step (an all-gather launched by the optimizer step) is waited for inside
    # the next step, not hidden in a barrier.
    dist.barrier()
    samples = timed_rounds({cfg["impl"]: step}, cfg["iters"], cfg["warmup"],
                           meters={"times": CpuClock(), "cpu": Counter(time.process_time),
                                   "faults": Counter(fresh_memory_counter(rt.device))})
    return {**{meter: by_impl[cfg["impl"]] for meter, by_impl in samples.items()}, "params": params, "kept": kept}


def launch_summary(per_rank: list[dict]) -> dict:
    """One launch: per step the slowest rank's wall and CPU time and the most faults; their medians."""
    return {key: statistics.median(max(values) for values in zip(*(r[key] for r in per_rank)))
            for key in ("times", "cpu", "faults")}


def compare(launches: dict[str, list[dict]], ours: str, theirs: str, key: str = "times") -> dict:
    """``ours`` against ``theirs`` over the launches both finished: each one's median of its launch
    medians, their ratio, and (p10, median, p90) and (min, max) of the per-launch ratios."""
    n = min(len(launches[ours]), len(launches[theirs]))
    a = [s[key] for s in launches[ours][:n]]
    b = [s[key] for s in launches[theirs][:n]]
    ratios = [x / y for x, y in zip(a, b)]
    return {"launches": n, "ours": statistics.median(a), "theirs": statistics.median(b),
            "ratio": statistics.median(a) / statistics.median(b), "spread": spread(ratios),
            "range": (min(ratios), max(ratios))}


def run(cfg: dict, *, comparisons: list[str], launches: int, world_size: int, backend: str, timeout: float) -> None:
    """Run every row's pair ``launches`` times each, alternating, and print the table (options
    checked by the CLI). Interrupted, it prints the table of the launch pairs that finished."""
    comparisons = [c for c in COMPARISONS if c in comparisons]  # like-for-like rows first
    done: dict[tuple[str, str], list[dict]] = {(c, impl): [] for c in comparisons for impl, _ in COMPARISONS[c]}
    facts: dict = {}

    def save_partial() -> str | None:
        finished = min(len(v) for v in done.values())
        if not finished:
            return None
        _report(done, facts, cfg, comparisons, world_size, backend)
        return f"the table above ({finished} of {launches} launches each)"

    with keep_partial(save_partial):
        for i in range(launches):
            for c in comparisons:
                pair = COMPARISONS[c]
                for side in pair if i % 2 == 0 else pair[::-1]:  # neither always goes first
                    per_rank = commlab.launch(_bench_rank, side_cfg(cfg, side), world_size=world_size,
                                              backend=backend, timeout=timeout)
                    facts = {"params": per_rank[0]["params"], "kept": per_rank[0]["kept"]}
                    done[(c, side[0])].append(launch_summary(per_rank))
    _report(done, facts, cfg, comparisons, world_size, backend)


def _report(done: dict[tuple[str, str], list[dict]], facts: dict, cfg: dict, comparisons: list[str],
            world_size: int, backend: str) -> None:
    reshard = "reshard after forward" if cfg["reshard"] else "no reshard after forward"
    click.echo(
        f"model mlp ({cfg['depth']} x {cfg['width']}), {facts['params'] / 1e6:.1f} M params, batch {cfg['batch']}/rank, "
        f"world {world_size}, {backend}, SGD; {cfg['iters']} timed steps after {cfg['warmup']} warm-up per launch, "
        "slowest rank per step, median per launch"
    )
    heap = "fixed glibc trim/mmap thresholds" if facts["kept"] else "the allocator's default heap trimming"
    click.echo(f"memory: {heap}")
    for c in comparisons:
        (ours, _), (theirs, _) = COMPARISONS[c]
        rows = {impl: done[(c, impl)] for impl in (ours, theirs)}
        s, cpu = compare(rows, ours, theirs), compare(rows, ours, theirs, "cpu")
        setting = (f"units: each Linear, {reshard}" if ours == "stage3" else f"{cfg['bucket_mb']:g} MiB buckets")
        headline = ", the headline" if c == HEADLINE else ""
        click.echo(f"[{c}{headline}] {LABELS[ours]} vs {LABELS[theirs]} ({setting}), {s['launches']} launches each, "
                   "alternating")
        for side in COMPARISONS[c]:
            click.echo(f"  {LABELS[side[0]]} runs: {runs(side_cfg(cfg, side), backend)}")
        click.echo("                       wall ms/step   cpu ms/step   faults/step   (medians over launches)")
        for impl, key in ((ours, "ours"), (theirs, "theirs")):
            f = statistics.median(x["faults"] for x in rows[impl][: s["launches"]])
            click.echo(f"  {LABELS[impl]:<19}  {s[key] * 1e3:12.2f}  {cpu[key] * 1e3:12.2f}  {f:12.0f}")
        p10, med, p90 = s["spread"]
        lo, hi = s["range"]
        click.echo(f"  ratio {LABELS[ours]}/{LABELS[theirs]}: {s['ratio']:.3f} "
                   f"(per launch p10 / median / p90 {p10:.3f} / {med:.3f} / {p90:.3f}, min-max {lo:.3f}-{hi:.3f})")
        click.echo(f"  cpu-time ratio: {cpu['ratio']:.3f} (per launch min-max {cpu['range'][0]:.3f}-{cpu['range'][1]:.3f})")
