"""The data-parallel wrapper a sweep configuration names, and what one step of it sent and measured.

Stage 0 is commlab's DDP (the sweep as it always was); stages 1-3 are commlab.ShardedDataParallel
with the configuration's bucket cap, prefetch, reshard and algorithm. For the sharded stages this
module turns a :class:`commlab.sharded.ShardedIterationTiming` into the sweep's iteration row (the
DDP columns of commlab/runs/store.py) and bucket rows, and counts the bytes a step sends.

Bytes sent per rank are counted by commlab/runs/traffic.py, whatever algorithm actually ran.
"""

from __future__ import annotations

from statistics import median
from typing import Any

from commlab.runs.traffic import comm_bytes, hybrid_comm_bytes


def wrap(cfg, model, process_group=None, replicate_group=None):
    """The configuration's wrapper around ``model`` over ``process_group`` (the data-parallel
    ranks, or with hybrid sharding the shard group; None: the world) and ``replicate_group`` (the
    ranks holding the same shards, hybrid sharding only), inside the process group."""
    import commlab

    if cfg.zero_stage.ddp:
        return commlab.DistributedDataParallel(model, process_group=process_group, **ddp_options(cfg))
    return commlab.ShardedDataParallel(
        model, stage=cfg.stage, bucket_cap_mb=cfg.bucket_mb, prefetch=cfg.prefetch,
        reshard_after_forward=cfg.reshard, algorithm=cfg.algorithm, process_group=process_group,
        **({"replicate_group": replicate_group} if replicate_group is not None else {}),
    )


def ddp_options(cfg) -> dict[str, Any]:
    """commlab DDP's keyword arguments for the configuration (a pipeline's stages take them too)."""
    return dict(bucket_cap_mb=cfg.bucket_mb, algorithm=cfg.algorithm, overlap=cfg.overlap,
                round_robin_groups=cfg.groups, bucket_policy=cfg.bucket_policy)


def iteration_row(t) -> dict[str, float]:
    """A sharded iteration as the sweep's DDP columns: ``comm`` spans the reductions (first
    launched to last done, as DDP's spans its all-reduces), ``exposed_comm`` is the reductions'
    wait after backward compute (DDP's meaning; the all-gathers' waits lie inside forward and
    backward and are reported apart, as ``exposed_allgather``)."""
    reductions = [c for c in t.collectives if c.kind != "all_gather"]
    comm = max(c.done for c in reductions) - min(c.launched for c in reductions) if reductions else 0.0
    return {"forward": t.forward, "backward_compute": t.backward, "comm": comm, "exposed_comm": t.exposed_reduction,
            "total": t.total, "write_back": 0.0, "unused_allreduce": 0.0}


def bucket_rows(t, num_params: list[int]) -> list[dict[str, Any]]:
    """Each bucket's reduction (reduce-scatter, or stage 1's all-reduce) in the columns of buckets.csv."""
    return [{"bucket": c.bucket, "nbytes": c.nbytes, "num_params": num_params[c.bucket], "ready": c.ready,
             "launched": c.launched, "done": c.done} for c in t.collectives if c.kind != "all_gather"]


def step_measures(wrapper, cfg, timings: list) -> dict[str, float]:
    """comm_bytes and the exposed all-gather / reduction seconds of one rank: medians over its
    measured iterations (DDP: the all-reduced buckets, nothing exposed by gathers)."""
    if not timings:
        return {"comm_bytes": 0.0, "exposed_allgather": 0.0, "exposed_reducescatter": 0.0}
    if cfg.zero_stage.ddp:
        sent = [comm_bytes((("all_reduce", b.nbytes) for b in t.buckets), cfg.dp) for t in timings]
        return {"comm_bytes": median(sent), "exposed_allgather": 0.0, "exposed_reducescatter": 0.0}
    sent = [hybrid_comm_bytes(((c.kind, c.nbytes) for c in t.collectives), cfg.shard, cfg.replicas) for t in timings]
    return {"comm_bytes": median(sent), "exposed_allgather": median(t.exposed_all_gather for t in timings),
            "exposed_reducescatter": median(t.exposed_reduction for t in timings)}


def summary(per_rank: list[dict[str, Any]]) -> dict[str, float]:
    """The runs.csv measures of a configuration from its ranks' (store.MEASURE_COLUMNS): the
    highest peak and bytes of any rank, the median of the ranks' exposed seconds."""
    rows = [r["measures"] for r in per_rank if r.get("measures")]
    if not rows:
        return {}
    return {"peak_bytes": max(r["peak_bytes"] for r in rows), "comm_bytes": max(r["comm_bytes"] for r in rows),
            "exposed_allgather": median(r["exposed_allgather"] for r in rows),
            "exposed_reducescatter": median(r["exposed_reducescatter"] for r in rows)}
