"""`commlab bench tensor`: commlab's tensor parallelism against torch's ``parallelize_module``, in alternating launches.

Both split commlab's GPT with the same plan, q, k, v and the MLP's first layer by columns, the
attention projection and the MLP's second layer by rows (``commlab.tensor.gpt_plan()``; torch's
``ColwiseParallel`` and ``RowwiseParallel`` on a one-dimensional CPU mesh), train on the same
tokens (the same on every rank, as tensor parallelism needs) with plain SGD, on Gloo. What each
runs per block, counted in one untimed step after the timed ones (commlab's own timings; torch's
``CommDebugMode``), is printed above the table: both all-reduce each row layer's output in
forward; backward, torch all-reduces the input gradient of each column layer (q, k, v and fc:
four), commlab once per distinct input (q, k and v read the same one, as a fused qkv layer: two).

Each ``--algorithm`` is a commlab implementation (``native``, the backend's all-reduce as torch's
DTensor issues it, is the like-for-like row and printed first; ``ring`` etc. run commlab's
point-to-point all-reduce). Every implementation runs in a launch of its own and the launches
alternate, the order reversed every round, as `commlab bench sharded` does and for its reasons: a
launch times ``iters`` steps after ``warmup``, a step's time is the slowest rank's, a launch gives
its median; the table gives the median over launches and, per commlab row, the ratio to torch
with the spread of the per-launch ratios (launch i against launch i), in wall and CPU time:

    commlab bench tensor                              # GPT 4 x 512, native and ring, 6 launches each
    commlab bench tensor --algorithm native --launches 10 --batch 16

The options are declared in :mod:`commlab.cli.bench`; this module is the run.
"""

from __future__ import annotations

import itertools
import statistics
import time
import warnings

import click

import commlab
from commlab.bench.ddp_bench import fresh_memory_counter
from commlab.bench.sharded_bench import compare, launch_summary
from commlab.runtime.interrupt import keep_partial
from commlab.runtime.timer import Counter, CpuClock, timed_rounds

TORCH = "torch"
COLUMNS, ROWS = ("q", "k", "v", "fc"), ("proj", "out")  # gpt_plan()'s split layers of each block


def label(impl: str) -> str:
    return "torch parallelize_module" if impl == TORCH else f"commlab TP ({impl})"


def check(cfg: dict, world_size: int) -> None:
    """ValueError for a model or algorithm that cannot run, before any process starts: the model
    is built on the meta device and the plan checked against it (heads, features, vocabulary)."""
    import torch

    from commlab.collectives import algorithm_names
    from commlab.models import GPT
    from commlab.tensor import gpt_plan, resolve

    unknown = [a for a in cfg["algorithms"] if a not in algorithm_names()]
    if unknown or not cfg["algorithms"]:
        raise ValueError(f"unknown all-reduce algorithm(s) {', '.join(unknown) or '(none)'}: choose from "
                         f"{', '.join(algorithm_names())}")
    with torch.device("meta"):
        model = GPT(**_sizes(cfg))
    resolve(model, gpt_plan(), world_size)


def _sizes(cfg: dict) -> dict:
    return {k: cfg[k] for k in ("vocab", "d_model", "layers", "heads", "seq")}


def _parallelize(impl: str, model):
    if impl != TORCH:
        from commlab.tensor import gpt_plan, parallelize

        return parallelize(model, gpt_plan(), algorithm=impl)
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    plan = {**{f"layers.*.{n}": ColwiseParallel() for n in COLUMNS}, **{f"layers.*.{n}": RowwiseParallel() for n in ROWS}}
    return parallelize_module(model, init_device_mesh("cpu", (dist.get_world_size(),)), plan)


def _bench_rank(cfg: dict) -> dict:
    """One launch of one implementation: per timed step its wall and CPU time; then what it ran."""
    import torch
    import torch.distributed as dist

    from commlab.models import GPT, lm_loss

    torch.manual_seed(0)  # torch's parallelize_module does not broadcast: every rank builds the same
    model = GPT(**_sizes(cfg))
    params = sum(p.numel() for p in model.parameters())
    model = _parallelize(cfg["impl"], model)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    gen = torch.Generator().manual_seed(1)  # the same tokens on every rank
    tokens = [torch.randint(0, cfg["vocab"], (cfg["batch"], cfg["seq"] + 1), generator=gen) for _ in range(4)]
    feed = itertools.cycle(tokens)

    def step() -> None:
        t = next(feed)
        opt.zero_grad()
        lm_loss(model(t[:, :-1]), t[:, 1:]).backward()
        opt.step()

    dist.barrier()
    samples = timed_rounds({"step": step}, cfg["iters"], cfg["warmup"],
                           meters={"times": CpuClock(), "cpu": Counter(time.process_time),
                                   "faults": Counter(fresh_memory_counter(torch.device("cpu")))})
    return {**{meter: by_step["step"] for meter, by_step in samples.items()}, "ran": _what_it_runs(cfg, model, step),
            "params": params}


def _what_it_runs(cfg: dict, model, step) -> dict:
    """Collectives per block and phase in one more step (untimed), and commlab's seconds in them."""
    per = cfg["layers"]
    if cfg["impl"] == TORCH:
        from torch.distributed.tensor.debug import CommDebugMode

        mode = CommDebugMode()
        with warnings.catch_warnings(), mode:  # its module tracker warns about hooks on the input-less embedding
            warnings.simplefilter("ignore")
            step()
        counts = mode.comm_module_counts["Global"]
        return {phase: {str(op).rpartition(".")[2]: n / per for op, n in counts.get(phase, {}).items()}
                for phase in ("forward", "backward")}
    from commlab.tensor import record_timings, timings

    record_timings(model)
    step()
    it = timings(model)[-1]
    ran: dict = {"forward": {}, "backward": {}, "comm_s": it.exposed_comm}
    for layer in it.layers:
        for (phase, kind), n in layer.counts.items():
            ran[phase][kind] = ran[phase].get(kind, 0) + n / per
    return ran


def run(cfg: dict, *, launches: int, world_size: int, timeout: float) -> None:
    """Every implementation ``launches`` times, alternating, then the table (options checked by the
    CLI). Interrupted, it prints the table of the rounds that finished."""
    impls = [*cfg["algorithms"], TORCH]
    done: dict[str, list[dict]] = {impl: [] for impl in impls}
    facts: dict = {}

    def save_partial() -> str | None:
        finished = min(len(v) for v in done.values())
        if not finished:
            return None
        _report(done, facts, cfg, world_size)
        return f"the table above ({finished} of {launches} launches each)"

    with keep_partial(save_partial):
        for i in range(launches):
            for impl in impls if i % 2 == 0 else impls[::-1]:  # none always goes first
                per_rank = commlab.launch(_bench_rank, {**cfg, "impl": impl}, world_size=world_size, backend="gloo",
                                          timeout=timeout)
                facts[impl], facts["params"] = per_rank[0]["ran"], per_rank[0]["params"]
                done[impl].append(launch_summary(per_rank))
    _report(done, facts, cfg, world_size)


def _ran(counts: dict) -> str:
    return ", ".join(f"{n:g} {kind}" for kind, n in counts.items()) or "nothing"


def _report(done: dict[str, list[dict]], facts: dict, cfg: dict, world_size: int) -> None:
    click.echo(f"model gpt ({cfg['layers']} layers, d_model {cfg['d_model']}, {cfg['heads']} heads, vocab {cfg['vocab']}), "
               f"{facts['params'] / 1e6:.1f} M params, batch {cfg['batch']} x {cfg['seq']} tokens (the same on every "
               f"rank), world {world_size}, gloo, SGD; {cfg['iters']} timed steps after {cfg['warmup']} warm-up "
               "per launch, slowest rank per step, median per launch")
    click.echo("what each runs, collectives per block (one untimed step; torch's from CommDebugMode):")
    for impl in [TORCH, *cfg["algorithms"]]:
        ran = facts.get(impl)
        if ran is None:
            continue
        extra = f"; {ran['comm_s'] * 1e3:.1f} ms/step in them (its timings)" if "comm_s" in ran else ""
        click.echo(f"  {label(impl):<25} forward {_ran(ran['forward'])}; backward {_ran(ran['backward'])}{extra}")
    n = min(len(v) for v in done.values())
    click.echo(f"commlab TP vs torch parallelize_module, {n} launches each, alternating")
    click.echo("                             wall ms/step   cpu ms/step   (medians over launches)")
    for impl in [cfg["algorithms"][0], TORCH, *cfg["algorithms"][1:]]:
        wall = statistics.median(s["times"] for s in done[impl][:n])
        cpu = statistics.median(s["cpu"] for s in done[impl][:n])
        click.echo(f"  {label(impl):<25}  {wall * 1e3:12.2f}  {cpu * 1e3:12.2f}")
    for impl in cfg["algorithms"]:
        s, c = compare(done, impl, TORCH), compare(done, impl, TORCH, "cpu")
        p10, med, p90 = s["spread"]
        click.echo(f"  ratio {label(impl)}/torch: {s['ratio']:.3f} (per launch p10 / median / p90 {p10:.3f} / {med:.3f} / "
                   f"{p90:.3f}, min-max {s['range'][0]:.3f}-{s['range'][1]:.3f}); cpu-time ratio {c['ratio']:.3f}")
