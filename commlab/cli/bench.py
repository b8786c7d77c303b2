"""The `commlab bench` commands' options: `bench ddp`, `bench sharded`, `bench tensor`, `bench collectives`.

Click declarations and input checks only; the runs live in :mod:`commlab.bench.ddp_bench`,
:mod:`commlab.bench.sharded_bench`, :mod:`commlab.bench.tensor_bench` and
:mod:`commlab.bench.collectives_bench`. Everything that imports torch (those modules,
commlab.models, commlab.collectives) is imported inside the commands, so ``--help`` and bad
input answer in a fraction of a second.

\b
    commlab bench ddp --bucket-mb 5 --algorithm ring
    commlab bench sharded --compare ring,native,fully_shard --launches 6
    commlab bench tensor --algorithm native,ring --launches 6
    commlab bench collectives -b 4M -e 64M -f 2 --world-size 2,4 --algorithm ring,native
"""

from __future__ import annotations

import click

from commlab.cli.writable import check_writable

DTYPES = {"float32": 4, "float64": 8, "float16": 2, "bfloat16": 2, "int32": 4, "int64": 8}
OPS = ("sum", "avg", "max", "min")


class _Size(click.ParamType):
    name = "SIZE"

    def convert(self, value, param, ctx):
        from commlab.runs.traffic import parse_size  # numpy: not for --help

        try:
            return parse_size(value)
        except ValueError as e:
            self.fail(str(e), param, ctx)


def _int_list(value: str, name: str, minimum: int) -> list[int]:
    try:
        items = [int(v) for v in value.split(",") if v.strip()]
    except ValueError:
        raise click.BadParameter(f"expected comma-separated integers, got {value!r}", param_hint=name) from None
    if not items or min(items) < minimum:
        raise click.BadParameter(f"expected integers >= {minimum}, got {value!r}", param_hint=name)
    return list(dict.fromkeys(items))


def _check_capacity(world: int, data_bytes_per_rank: int, oversubscribe: bool) -> None:
    """The sweep's rule for local CPU ranks (commlab.runtime.capacity), before any process starts.

    Each rank gets the threads commlab.launch gives it (commlab/runtime/threads.py's rule), out of
    the cores this process may run on.
    """
    from commlab.runtime.capacity import check_local_ranks
    from commlab.runtime.metadata import cpu_count
    from commlab.runtime.threads import threads_per_rank

    if oversubscribe:
        return
    try:
        check_local_ranks(world, threads_per_rank(world, cores=cpu_count()), data_bytes_per_rank)
    except ValueError as e:
        raise click.BadParameter(f"{e}; or add --oversubscribe to run it anyway", param_hint="--world-size") from None


_OVERSUBSCRIBE = click.option(
    "--oversubscribe", is_flag=True,
    help="Run even with more CPU ranks than twice the cores, or than the memory holds (refused by default).")


def _backends(backend: str, worlds: list[int]) -> dict[int, str]:
    from commlab.runtime import resolve_backend

    try:
        return {w: resolve_backend(backend, w) for w in worlds}
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--backend/--world-size") from None


@click.command("collectives")
@click.option("-b", "--min-bytes", type=_Size(), default="1K", show_default=True, help="Smallest message (1K, 64M, ...).")
@click.option("-e", "--max-bytes", type=_Size(), default="16M", show_default=True, help="Largest message.")
@click.option("-f", "--step-factor", type=click.IntRange(min=2), default=4, show_default=True, help="Size multiplier.")
@click.option("-n", "--iters", type=click.IntRange(min=1), default=10, show_default=True, help="Timed iterations per size.")
@click.option("-w", "--warmup", type=click.IntRange(min=0), default=2, show_default=True, help="Untimed iterations first.")
@click.option("--collective", default="all_reduce", show_default=True,
              help="Comma list of collectives: all_reduce, reduce_scatter, all_gather, broadcast (or a plug-in's name).")
@click.option("--algorithm", "algorithm", default="all", show_default=True,
              help="Comma list of algorithms, or all (each collective runs those of them it has).")
@click.option("--world-size", "world_size", default="2", show_default=True, help="Comma list of world sizes.")
@click.option("--backend", type=click.Choice(["auto", "gloo", "nccl"]), default="gloo", show_default=True,
              help="process group backend; auto: NCCL when every rank has its own GPU, else Gloo")
@click.option("--dtype", type=click.Choice(list(DTYPES)), default="float32", show_default=True, help="Element type of the buffers.")
@click.option("--op", type=click.Choice(OPS), default="sum", show_default=True,
              help="Reduction of the reducing collectives (all_reduce, reduce_scatter).")
@click.option("--check/--no-check", default=True, show_default=True, help="Count wrong elements (#wrong).")
@click.option("--out", "out_dir", type=click.Path(file_okay=False), default="results/collectives", show_default=True,
              help="Directory of the CSV, metadata and figure.")
@click.option("--timeout", type=click.FloatRange(min=1), default=900.0, show_default=True, help="Seconds per world size.")
@click.option("--repeat", type=click.IntRange(min=1), default=1, show_default=True,
              help="Run the whole sweep N times; with native among the algorithms, print each run's ratios to it.")
@_OVERSUBSCRIBE
def bench_collectives(min_bytes, max_bytes, step_factor, iters, warmup, collective, algorithm, world_size, backend,
                      dtype, op, check, out_dir, timeout, repeat, oversubscribe):
    """nccl-tests-style benchmark of collectives and their algorithms (interleaved, fair comparison)."""
    from commlab.bench import collectives_bench  # imports torch: inside the command
    from commlab.costmodel.terms.alpha_beta import size_sweep

    from commlab.bench.collectives_plugins import collective_names

    check_writable(out_dir)
    names = list(dict.fromkeys(c.strip() for c in collective.split(",") if c.strip()))
    if not names or (unknown := [c for c in names if c not in collective_names()]):
        raise click.BadParameter(f"unknown collective(s) {', '.join(unknown) or repr(collective)}: choose from "
                                 f"{', '.join(collective_names())}", param_hint="--collective")
    try:
        collectives = collectives_bench.choose(names, algorithm)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--algorithm") from None
    worlds = _int_list(world_size, "--world-size", 1)
    # An algorithm named that cannot run on a world size (halving-doubling's halves on 3 ranks) is
    # refused; "all" runs, at each world size, those that can (collectives_bench.for_world).
    for world in worlds:
        runnable, skipped = collectives_bench.for_world(collectives, world)
        if algorithm.strip() != "all" and skipped or not runnable:
            raise click.BadParameter("; ".join(line.removeprefix("# ") for line in skipped),
                                     param_hint="--algorithm/--world-size")
    try:
        sizes = size_sweep(min_bytes, max_bytes, step_factor, DTYPES[dtype])
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="-b/-e") from None
    backends = _backends(backend, worlds)
    for world in worlds:
        if backends[world] == "gloo":  # input, work buffer, expected result and the algorithms' own
            _check_capacity(world, 4 * sizes[-1], oversubscribe)
    collectives_bench.run(sizes=sizes, collectives=collectives, worlds=worlds, backends=backends, dtype=dtype, op=op,
                          iters=iters, warmup=warmup, check=check, out_dir=out_dir, timeout=timeout, repeat=repeat)


@click.command("ddp")
@click.option("--model", default="mlp", show_default=True, help="mlp, transformer, gpt, resnet50, bert or package.module:factory")
@click.option("--depth", default=12, show_default=True, type=click.IntRange(min=1), help="MLP layers")
@click.option("--width", default=1024, show_default=True, type=click.IntRange(min=1), help="MLP width")
@click.option("--batch", default=64, show_default=True, type=click.IntRange(min=1), help="per-rank batch size")
@click.option("--world-size", default=2, show_default=True, type=click.IntRange(min=1), help="local ranks")
@click.option("--backend", default="gloo", show_default=True, type=click.Choice(["auto", "gloo", "nccl"]),
              help="process group backend; auto: NCCL when every rank has its own GPU, else Gloo")
@click.option("--bucket-mb", default=25.0, show_default=True, type=click.FloatRange(min=0, min_open=True),
              help="bucket_cap_mb (MiB) of both DDPs")
@click.option("--iters", default=20, show_default=True, type=click.IntRange(min=1), help="timed iterations each")
@click.option("--warmup", default=5, show_default=True, type=click.IntRange(min=0), help="untimed iterations each")
@click.option("--algorithm", default="native", show_default=True, help="commlab's all-reduce for each bucket")
@click.option("--glibc-trim/--no-glibc-trim", default=False, show_default=True,
              help="leave glibc's heap trimming as is (default: fixed trim and mmap thresholds, so that where "
              "glibc happens to place the gradients does not decide which DDP page-faults)")
@click.option("--timeout", default=600.0, show_default=True, type=click.FloatRange(min=0, min_open=True),
              help="seconds before the launch is abandoned")
@_OVERSUBSCRIBE
def bench_ddp(model, depth, width, batch, world_size, backend, bucket_mb, iters, warmup, algorithm, glibc_trim, timeout,
              oversubscribe):
    """commlab DDP vs torch DDP on the same model and data, alternating; medians and ratio."""
    from commlab.collectives import algorithm_names
    from commlab.models import check_workload

    try:  # a user's module:factory is imported here, so that a missing one fails before any rank
        check_workload(model, **({"depth": depth, "width": width} if model == "mlp" else {}))
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--model") from None
    if algorithm not in algorithm_names():
        raise click.BadParameter(f"{algorithm!r} is not one of {', '.join(algorithm_names())}", param_hint="--algorithm")
    backend = _backends(backend, [world_size])[world_size]
    if backend == "gloo":
        _check_capacity(world_size, 0, oversubscribe)
    from commlab.bench import ddp_bench

    ddp_bench.run(dict(model=model, depth=depth, width=width, batch=batch, bucket_mb=bucket_mb, iters=iters,
                       warmup=warmup, algorithm=algorithm, keep_freed=not glibc_trim),
                  world_size=world_size, backend=backend, timeout=timeout)


@click.command("sharded")
@click.option("--compare", "comparisons", default="ring,native,fully_shard", show_default=True,
              help="Comma list of rows: ring (commlab stage 3 vs torch's fully_shard, both on commlab's ring; "
              "the headline), native (both on Gloo's collectives), fully_shard (commlab as --algorithm and "
              "--prefetch say vs fully_shard as is), ddp (stage 2 vs commlab DDP).")
@click.option("--depth", default=8, show_default=True, type=click.IntRange(min=1), help="MLP layers")
@click.option("--width", default=1024, show_default=True, type=click.IntRange(min=1), help="MLP width")
@click.option("--batch", default=16, show_default=True, type=click.IntRange(min=1),
              help="per-rank batch size (small: the parameters outweigh the activations)")
@click.option("--launches", default=6, show_default=True, type=click.IntRange(min=1), help="launches of each implementation")
@click.option("--iters", default=20, show_default=True, type=click.IntRange(min=1), help="timed steps per launch")
@click.option("--warmup", default=5, show_default=True, type=click.IntRange(min=0), help="untimed steps per launch")
@click.option("--reshard/--no-reshard", default=True, show_default=True,
              help="reshard_after_forward of both stage-3 implementations")
@click.option("--prefetch", default=1, show_default=True, type=click.IntRange(min=0),
              help="commlab stage 3's prefetch in the fully_shard row (the ring and native rows run 0: "
              "fully_shard's all-gathers block on CPU)")
@click.option("--bucket-mb", default=25.0, show_default=True, type=click.FloatRange(min=0, min_open=True),
              help="bucket_cap_mb (MiB) of stage 2 and of commlab DDP")
@click.option("--algorithm", default="auto", show_default=True,
              help="collectives of commlab in the fully_shard and ddp rows: auto (each one's default: the stages' ring on Gloo, "
              "DDP's native), native (the backend's), ring or halving_doubling (commlab's p2p; halving_doubling "
              "on a power-of-two world size)")
@click.option("--world-size", default=2, show_default=True, type=click.IntRange(min=1), help="local ranks")
@click.option("--glibc-trim/--no-glibc-trim", default=False, show_default=True,
              help="leave glibc's heap trimming as is (default: fixed trim and mmap thresholds, as bench ddp)")
@click.option("--timeout", default=600.0, show_default=True, type=click.FloatRange(min=0, min_open=True),
              help="seconds before a launch is abandoned")
@_OVERSUBSCRIBE
def bench_sharded(comparisons, depth, width, batch, launches, iters, warmup, reshard, prefetch, bucket_mb, algorithm,
                  world_size, glibc_trim, timeout, oversubscribe):
    """commlab sharded DP vs torch fully_shard (on the same ring, on Gloo's, as is) and commlab DDP, alternating
    separate launches (Gloo, CPU)."""
    # Inside the command: the module itself imports no torch (its ranks do), but is not needed for --help.
    from commlab.bench import sharded_bench

    names = list(dict.fromkeys(c.strip() for c in comparisons.split(",") if c.strip()))
    unknown = [c for c in names if c not in sharded_bench.COMPARISONS]
    if not names or unknown:
        raise click.BadParameter(f"unknown comparison(s) {', '.join(unknown) or repr(comparisons)}: choose from "
                                 f"{', '.join(sharded_bench.COMPARISONS)}", param_hint="--compare")
    from commlab.sharded.comm import CHOICES, check_algorithm  # imports torch: after --help

    if algorithm not in CHOICES:
        raise click.BadParameter(f"{algorithm!r} is not one of {', '.join(CHOICES)} (the algorithms with a "
                                 "reduce-scatter and an all-gather)", param_hint="--algorithm")
    try:
        check_algorithm(algorithm, world_size)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--algorithm/--world-size") from None
    params = depth * width * (width + 1) + 10 * (width + 1)
    # fp32 parameters, gradients and the gathered or bucketed copies of both: about 4 copies a rank
    _check_capacity(world_size, 4 * 4 * params, oversubscribe)
    sharded_bench.run(dict(depth=depth, width=width, batch=batch, iters=iters, warmup=warmup, reshard=reshard,
                           prefetch=prefetch, bucket_mb=bucket_mb, algorithm=algorithm, keep_freed=not glibc_trim),
                      comparisons=names, launches=launches, world_size=world_size, backend="gloo", timeout=timeout)


@click.command("tensor")
@click.option("--algorithm", "algorithms", default="native,ring", show_default=True,
              help="Comma list of commlab's all-reduce algorithms, one commlab row each against torch "
              "(native: the backend's all-reduce, as torch's DTensor issues it)")
@click.option("--layers", default=4, show_default=True, type=click.IntRange(min=1), help="GPT blocks")
@click.option("--d-model", default=512, show_default=True, type=click.IntRange(min=1), help="GPT width")
@click.option("--heads", default=4, show_default=True, type=click.IntRange(min=1), help="attention heads")
@click.option("--vocab", default=256, show_default=True, type=click.IntRange(min=1), help="vocabulary size")
@click.option("--seq", default=32, show_default=True, type=click.IntRange(min=1), help="tokens per sequence")
@click.option("--batch", default=8, show_default=True, type=click.IntRange(min=1), help="sequences per step (every rank's)")
@click.option("--launches", default=6, show_default=True, type=click.IntRange(min=1), help="launches of each implementation")
@click.option("--iters", default=20, show_default=True, type=click.IntRange(min=1), help="timed steps per launch")
@click.option("--warmup", default=3, show_default=True, type=click.IntRange(min=0), help="untimed steps per launch")
@click.option("--world-size", default=2, show_default=True, type=click.IntRange(min=2), help="local ranks: the TP size")
@click.option("--timeout", default=600.0, show_default=True, type=click.FloatRange(min=0, min_open=True),
              help="seconds before a launch is abandoned")
@_OVERSUBSCRIBE
def bench_tensor(algorithms, layers, d_model, heads, vocab, seq, batch, launches, iters, warmup, world_size, timeout,
                 oversubscribe):
    """commlab tensor parallelism vs torch parallelize_module on the GPT, alternating separate launches (Gloo, CPU)."""
    from commlab.bench import tensor_bench  # imports torch in its checks: inside the command

    cfg = dict(algorithms=list(dict.fromkeys(a.strip() for a in algorithms.split(",") if a.strip())), layers=layers,
               d_model=d_model, heads=heads, vocab=vocab, seq=seq, batch=batch, iters=iters, warmup=warmup)
    try:
        tensor_bench.check(cfg, world_size)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--algorithm/--heads/--d-model/--vocab/--world-size") from None
    _check_capacity(world_size, 0, oversubscribe)
    tensor_bench.run(cfg, launches=launches, world_size=world_size, timeout=timeout)
