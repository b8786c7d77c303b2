"""A sweep grid: defaults, then a YAML spec, then the command line, expanded into configurations.

Everything here is pure: a spec (dict of option name -> raw value, from YAML or click) becomes a
validated :class:`Grid` holding the list of :class:`~commlab.runs.config.Config`, one per point.
Errors are ``ValueError`` with a message meant for the user; the CLI turns them into click errors
before any process starts.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

from commlab.runs.config import DEFAULTS, LATER_FIELDS, LAUNCHERS, SCALINGS, Config, optimizer_default
from commlab.runs.options import (
    canonical_model_args,
    non_negative_int,
    optimizer_value,
    overlap_values,
    parse_list,
    positive_float,
    positive_int,
    stage_value,
)
from commlab.runs.zero_stage import parse_stage


@dataclass(frozen=True)
class Grid:
    """A validated sweep: the grid plus how to run it."""

    configs: tuple[Config, ...]
    out: str
    name: str | None
    launcher: str
    timeout: float
    nnodes: int
    rdzv_endpoint: str | None
    repeat: int = 1  # the grid is run this many times (see commlab.sweep.runner.order)


def merge(spec: dict[str, Any], cli: dict[str, Any]) -> dict[str, Any]:
    """Defaults, then the YAML spec, then the options given on the command line."""
    spec = {k.replace("-", "_"): v for k, v in (spec or {}).items()}
    unknown = sorted(set(spec) - set(DEFAULTS))
    if unknown:
        raise ValueError(f"unknown key(s) in the spec file: {', '.join(unknown)}")
    merged = {**DEFAULTS, **spec}
    given = {k: v for k, v in cli.items() if v is not None}
    merged.update(given)
    if merged["dp"] is not None and "world_size" not in spec and "world_size" not in given:
        merged["world_size"] = None  # --dp names the data-parallel size: the world size is the product
    if merged["batch_per_rank"] is not None and "scaling" not in spec and "scaling" not in given:
        merged["scaling"] = "weak"  # a per-rank batch with no scaling named means weak scaling
    return merged


def build_grid(options: dict[str, Any]) -> Grid:
    """Validate merged options and expand the grid (model x backend x world size x ... x overlap)."""
    o = options
    scaling = str(o["scaling"]).lower()
    if scaling not in SCALINGS:
        raise ValueError(f"--scaling: {o['scaling']!r} is not one of {', '.join(SCALINGS)}")
    launcher = str(o["launcher"]).lower()
    if launcher not in LAUNCHERS:
        raise ValueError(f"--launcher: {o['launcher']!r} is not one of {', '.join(LAUNCHERS)}")
    if scaling == "weak" and o.get("batch_per_rank") is None:
        raise ValueError("--scaling weak needs --batch-per-rank")
    models = parse_list(o["model"], lambda t, _: t, "model")
    backends = parse_list(o["backend"], lambda t, _: t.lower(), "backend")
    tps, pps = parse_list(o["tp"], positive_int, "tp"), parse_list(o["pp"], positive_int, "pp")
    layouts = layout_sizes(o.get("world_size"), tps, pps, o.get("dp"))
    buckets = parse_list(o["bucket_mb"], positive_float, "bucket_mb")
    algorithms = parse_list(o["algorithm"], lambda t, _: t, "algorithm")
    accumulates = parse_list(o["accumulate"], positive_int, "accumulate")
    groups = parse_list(o["groups"], positive_int, "groups")
    threads = parse_list(o["threads"], positive_int, "threads")
    overlaps = overlap_values(o["overlap"])
    iters = positive_int(str(o["iters"]), "iters")
    warmup = int(o["warmup"]) if str(o["warmup"]).lstrip("-").isdigit() else -1
    if warmup < 0:
        raise ValueError(f"--warmup: {o['warmup']!r} must be a non-negative integer")
    timeout = positive_float(str(o["timeout"]), "timeout")
    repeat = positive_int(str(o["repeat"]), "repeat")
    nnodes = positive_int(str(o["nnodes"]), "nnodes")
    model_args = canonical_model_args(o["model_args"])
    policies = parse_list(o["bucket_policy"], lambda t, _: t, "bucket_policy")
    if policies != [DEFAULTS["bucket_policy"]]:
        # Lazy: the registry lives beside DDP, which imports torch; a plan with the default stays torch-free.
        from commlab.ddp.policy import make_policy

        for name in policies:
            make_policy(name)  # ValueError naming the registered policies
    stages = parse_list(o["stage"], stage_value, "stage")
    optimizers = parse_list(optimizer_default(stages) if o.get("optimizer") is None else o["optimizer"],
                            optimizer_value, "optimizer")
    prefetches = parse_list(o["prefetch"], non_negative_int, "prefetch")
    reshards = overlap_values(o["reshard"], "reshard")
    # None: 2 x pp micro-batches, chosen per layout below.
    microbatches = [None] if o.get("microbatches") is None else parse_list(o["microbatches"], positive_int, "microbatches")
    schedules = parse_list(o.get("schedule") or DEFAULTS["schedule"], lambda t, _: t.lower(), "schedule")
    shard_groups = parse_list(o.get("shard_group") or DEFAULTS["shard_group"], non_negative_int, "shard_group")
    if all(parse_stage(s).ddp for s in stages) and any(shard_groups):
        raise ValueError("--shard-group needs a --stage of 1-3: stage 0 (DDP) shards nothing")
    if not all(parse_stage(s).ddp for s in stages) and policies != [DEFAULTS["bucket_policy"]]:
        raise ValueError("--bucket-policy applies to stage 0 (DDP) only; ShardedDataParallel sizes its own buckets")
    if nnodes > 1 and launcher != "torchrun":
        raise ValueError("--nnodes > 1 needs --launcher torchrun")
    if nnodes > 1 and not o.get("rdzv_endpoint"):
        raise ValueError("--nnodes > 1 needs --rdzv-endpoint HOST:PORT")

    configs: dict[Config, None] = {}  # ordered, without the duplicates the collapsed axes make
    # Overlap innermost, bucket size next: the pairs a figure compares run back to back, so that
    # a drift in machine load between them stays small. The sharded axes go outside them.
    for (model, backend, (world, tp, pp, dp), micro, schedule, thread, algo, group, acc, policy, optimizer, stage,
         prefetch, reshard, shard, bucket, overlap) in itertools.product(
            models, backends, layouts, microbatches, schedules, threads, algorithms, groups, accumulates, policies,
            optimizers, stages, prefetches, reshards, shard_groups, buckets, overlaps):
        if pp == 1:  # no pipeline: one micro-batch, no schedule
            micro, schedule = LATER_FIELDS["microbatches"], LATER_FIELDS["schedule"]
        elif micro is None:
            micro = 2 * pp
        if pp > 1 and stage:
            raise ValueError(f"--pp {pp} --stage {stage}: a pipeline's stages are kept in sync by commlab DDP "
                             "(--stage 0) in a sweep; ZeRO under a pipeline shards each layer apart, and its "
                             "timings are not gathered into sweep rows")
        if not parse_stage(stage).parameters:  # prefetch and reshard gather parameters: stage 3's only
            prefetch, reshard = LATER_FIELDS["prefetch"], LATER_FIELDS["reshard"]
        if not parse_stage(stage).ddp:  # ShardedDataParallel always overlaps, on one process group
            overlap, group = True, 1
        shard = shard_group_of(shard, stage, dp)
        if world % nnodes:
            raise ValueError(f"--world-size {world} is not a multiple of --nnodes {nnodes}")
        if scaling == "strong":
            global_batch = positive_int(str(o["global_batch"]), "global_batch")
            # The batch splits over the data-parallel replicas: a tensor-parallel group shares one.
            if global_batch % dp:
                raise ValueError(
                    f"--global-batch {global_batch} does not split evenly over {dp} data-parallel rank(s) "
                    f"(world size {world}, strong scaling): pick a multiple, or use --scaling weak --batch-per-rank N"
                )
            per_rank = global_batch // dp
        else:
            per_rank = positive_int(str(o["batch_per_rank"]), "batch_per_rank")
            global_batch = per_rank * dp
        if per_rank % micro:
            named = "" if o.get("microbatches") is not None else " (the default, 2 x --pp)"
            raise ValueError(f"--microbatches {micro}{named} does not divide the batch of {per_rank} sample(s) per "
                             f"data-parallel replica (--pp {pp}, {dp} replica(s)): pick a divisor")
        configs[Config(model, model_args, backend, world, bucket, algo, overlap, acc, group, thread,
                       scaling, global_batch, per_rank, iters, warmup, policy, stage, prefetch, reshard,
                       optimizer, tp, pp, micro, schedule, shard)] = None
    return Grid(tuple(configs), str(o["out"]), o.get("name"), launcher, timeout, nnodes,
                o.get("rdzv_endpoint"), repeat)


def shard_group_of(shard: int, stage: int, dp: int) -> int:
    """The configuration's shard group: 0 (the whole data-parallel group) for DDP and for a size
    equal to dp; ValueError for one that does not divide dp (a hybrid layout is replicas x groups)."""
    if shard in (0, dp):
        return 0
    if parse_stage(stage).ddp:  # DDP shards nothing: the axis collapses (as prefetch does off stage 3)
        return 0
    if dp % shard:
        raise ValueError(f"--shard-group {shard} does not divide the {dp} data-parallel rank(s): hybrid sharding "
                         f"is replicas x shard groups of equal size")
    return shard


def layout_sizes(world_size, tps: list[int], pps: list[int], dp) -> list[tuple[int, int, int, int]]:
    """(world size, tp, pp, dp) of every layout the axes name, in their order.

    Without ``dp`` each world size is split as tp x pp x (the rest); with it (``world_size`` None)
    the world size is the product, and a world size given too must be that product.
    """
    if world_size is None and dp is None:
        raise ValueError("--world-size needs a value")
    worlds = None if world_size is None else parse_list(world_size, positive_int, "world_size")
    if dp is None:
        out = []
        for world, tp, pp in itertools.product(worlds, tps, pps):
            if world % (tp * pp):
                raise ValueError(f"--world-size {world} is not a multiple of --tp {tp} x --pp {pp}: "
                                 "the data-parallel size is world size / (tp x pp)")
            out.append((world, tp, pp, world // (tp * pp)))
        return out
    out = [(tp * pp * d, tp, pp, d) for d, tp, pp in
           itertools.product(parse_list(dp, positive_int, "dp"), tps, pps)]
    for world, tp, pp, d in out:
        if worlds is not None and world not in worlds:
            raise ValueError(f"--tp {tp} x --pp {pp} x --dp {d} makes world size {world}, not --world-size "
                             f"{','.join(map(str, worlds))}: the product of the axes is the world size "
                             "(leave out --world-size, or --dp)")
    return out


def grid_signature(grid: Grid) -> dict[str, Any]:
    """What a results directory holds: its configuration ids and repetitions (kept in metadata)."""
    return {"configs": sorted(c.id for c in grid.configs), "repeat": grid.repeat}


def grid_change(old: dict[str, Any] | None, new: dict[str, Any]) -> str | None:
    """How a resumed grid would change the recorded one, in words; None when it would not.

    Any option in a configuration (bucket sizes, world sizes, --iters, --threads, ...) is part of
    its id, so a changed grid or fixed option shows as configurations the run does not have.
    Resuming part of a run's grid adds nothing and is allowed. Results written before the grid
    was recorded have nothing to compare against.
    """
    if not old:
        return None
    added = sorted(set(new["configs"]) - set(old["configs"]))
    parts = [f"{len(added)} configuration(s) that it does not have (e.g. {added[0]})"] if added else []
    if old.get("repeat", 1) != new["repeat"]:
        parts.append(f"--repeat {new['repeat']} where the run has {old.get('repeat', 1)}")
    return "this grid would add " + " and ".join(parts) if parts else None


def grid_union(old: dict[str, Any] | None, new: dict[str, Any]) -> dict[str, Any]:
    """The grid a results directory holds after ``new`` ran in it (``--resume --force``)."""
    configs = sorted(set((old or {}).get("configs", [])) | set(new["configs"]))
    return {"configs": configs, "repeat": new["repeat"]}
