"""The sharded data-parallel step (ZeRO stages 1-3) lowered onto the simulator core: one optimizer step.

One representative rank, as in the DDP lowering (commlab/costmodel/lowering/ddp.py, whose costs,
contention model and bucket assignment it shares): a ``compute`` resource and one communication
channel ``chan0`` (the wrapper issues every collective on one process group, in order). In the
order the real engine (commlab/sharded/engine.py) does things:

- buckets: the bucket policy's rebuild for gradients ready in reverse parameter order, one cap for
  every bucket (the sharded wrapper's ``size_buckets``), in forward order;
- forward: one compute task per bucket, the profiled forward split in proportion to each
  bucket's backward time (the profile times forward as a whole), each after its bucket's
  all-gather. Stages 1-2: the previous optimizer step launched the first 1 + prefetch buckets'
  all-gathers (engine step 6), so the step starts with them queued, and bucket j's is launched
  when bucket j - 1 - prefetch is waited for (its forward pre-hook); stage 3: bucket j's
  all-gather is launched by the forward pre-hook of bucket j - prefetch (prefetch 0: just before use);
- backward: the profiled gradient-ready times (they include the copy into the bucket). Stage 3
  with reshard: bucket b is gathered again by the pre-backward hook of bucket b + prefetch
  (backward runs the buckets in reverse), and its first gradient waits for it;
- each bucket's reduction (stage 1: all-reduce, stages 2-3: reduce-scatter) is launched (the
  reducer's fixed cost per bucket) once its last gradient is ready, behind backward; stages 2-3
  first wait for the previous reduce-scatter (one in flight, as torch's fully_shard);
- hybrid sharding (HSDP: shards within a group of ``world_size`` ranks, ``replicas`` groups):
  each reduction is followed, on the same channel, by the all-reduce of its result across the
  replicas (stage 1: the bucket, stages 2-3: the rank's shard), and the wait for a reduction is a
  wait for both (commlab/sharded runs them as one job);
- the optimizer waits for every reduction and steps 1/world of the parameters.

Costs: the world-size-1 profile DDP uses, and calibrated ("reduce_scatter" | "all_gather",
algorithm, world) tables (hybrid: at the shard group's size, the cross-replica all-reduce at the
replicas'), and the cost of allocating a buffer anew (``fresh``: fresh pages on CPU,
faulted on first write), paid by every gather's buffer, stage 3's parameters, each step's
gradient buckets and the reduced shards; the copies around the collectives (copy-out after a
gather, the rows' copy-in after a step) are priced as DDP's write-back per byte. Not modelled:
buckets the root module uses itself (the engine keeps them gathered), the gathers of no_sync
micro-batches (accumulate > 1 adds only their compute), Gloo's second lane.
"""

from __future__ import annotations

from collections.abc import Sequence

from commlab.costmodel.lowering.buckets import assign
from commlab.costmodel.lowering.ddp import contention_rate
from commlab.costmodel.lowering.zero_costs import REPLICATE, ShardedCosts, ShardedSetting, sharded_costs
from commlab.runs.store import STEP_COLUMNS
from commlab.sim import SimResult, Task, simulate

__all__ = ["REPLICATE", "ShardedCosts", "ShardedSetting", "sharded_costs", "lower_sharded", "simulate_sharded",
           "sharded_breakdown", "peak_bytes", "comm_bytes"]

COMPUTE, CHANNEL, HOST = "compute", "chan0", "rank"
ALLGATHER, REDUCESCATTER, ALLREDUCE = "allgather", "reducescatter", "allreduce"
COMM_KINDS = (ALLREDUCE, ALLGATHER, REDUCESCATTER)
ELEMENT = 4  # bytes per element: the profiled parameters are fp32
SHARDED_COLUMNS = ("peak_bytes", "comm_bytes", "exposed_allgather", "exposed_reducescatter")


def sharded_buckets(costs: ShardedCosts, setting: ShardedSetting) -> list[list[int]]:
    """Buckets in forward order: the policy's rebuild for gradients ready in reverse parameter order,
    as ShardedDataParallel makes them (commlab/sharded/buckets.py; no first-bucket size there)."""
    n = len(costs.step.param_nbytes)
    buckets = assign(costs.step.param_nbytes, list(reversed(range(n))), policy=setting.policy,
                     bucket_cap_mb=setting.bucket_cap_mb)
    return sorted((sorted(b) for b in buckets), key=lambda b: b[0])


def padded_bytes(costs: ShardedCosts, buckets: Sequence[Sequence[int]]) -> list[int]:
    """Each bucket's rank-major buffer: every parameter's rows padded to a multiple of the world
    size (commlab/sharded/layout.py). Without the parameters' rows (a calibration made before they
    were recorded) each bucket is padded as one flat vector: low by up to N - 1 rows a parameter."""
    w, nbytes = costs.world_size, costs.step.param_nbytes
    if costs.rows is None:
        return [-(-sum(nbytes[p] for p in b) // (w * ELEMENT)) * w * ELEMENT for b in buckets]
    return [sum(-(-costs.rows[p] // w) * w * (nbytes[p] // costs.rows[p]) for p in b) for b in buckets]


def lower_sharded(costs: ShardedCosts, setting: ShardedSetting, buckets: Sequence[Sequence[int]]) -> list[Task]:
    """The task graph of one optimizer step (see the module docstring)."""
    sc, n, stage = costs.step, len(buckets), setting.stage
    full = padded_bytes(costs, buckets)
    owner = {p: b for b, ps in enumerate(buckets) for p in ps}
    pos = {p: j for j, p in enumerate(sc.ready_order)}
    grad_s = [t - (sc.ready_s[j - 1] if j else 0.0) for j, t in enumerate(sc.ready_s)]
    back = [sum(grad_s[pos[p]] for p in b) for b in buckets]
    share = [x / sum(back) for x in back] if sum(back) > 0 else [f / sum(full) for f in full]
    first = [min(pos[p] for p in b) for b in buckets]  # ready position where bucket b's backward starts
    # DDP's launch rule: after the bucket's last gradient, in the order buckets complete
    launches = sorted(range(n), key=lambda b: max(pos[p] for p in buckets[b]))
    when: dict[int, int] = {}
    for b in launches:
        last = max(pos[p] for p in buckets[b])
        when[b] = max(last, max(when.values(), default=last))
    tasks: list[Task] = []
    chan: list[tuple[tuple, Task]] = []  # (issue key, task): the channel runs them in issue order

    def compute(name: str, seconds: float, kind: str, deps: tuple[str, ...] = (), stretched: bool = True, **meta) -> None:
        tasks.append(Task(name, COMPUTE, max(seconds, 0.0) * (sc.corun if stretched else 1.0), deps, kind, HOST, meta=meta))

    def comm(key: tuple, name: str, kind: str, seconds: float, deps: tuple[str, ...], b: int) -> None:
        chan.append((key, Task(name, CHANNEL, seconds, deps, kind, HOST, meta={"bucket": b, "nbytes": full[b]})))

    before_forward: tuple[str, ...] = ()
    if setting.accumulate > 1:
        compute("nosync", (setting.accumulate - 1) * sc.nosync_s, "nosync")
        before_forward = ("nosync",)
    for j in range(n):  # forward all-gathers: launched by the optimizer step (1-2) or a pre-hook (3)
        hook = max(0, j - setting.prefetch - (1 if stage < 3 else 0))  # the bucket whose pre-hook launches j
        if stage < 3 and j <= setting.prefetch:
            deps: tuple[str, ...] = ()  # launched by the optimizer step
        else:
            deps = (f"fwd{hook - 1}",) if hook else before_forward
        # every gather receives into a rank-major buffer allocated for it (commlab/sharded/flat_bucket.py),
        # whose other ranks' blocks fault as they arrive (stages 1-2 copy their own block in first)
        received = costs.alloc(full[j]) * ((costs.world_size - 1) / costs.world_size if stage < 3 else 1.0)
        comm((0, j), f"gather{j}", ALLGATHER, costs.all_gather(full[j]) + received, deps, j)

    def copy_out(b: int) -> float:
        """The training thread's copy of a gathered bucket into its parameters, a memory copy priced
        as DDP's write-back per byte; stage 3 writes storage allocated again (fresh pages)."""
        return sc.writeback_s_per_byte * full[b] + (costs.alloc(full[b]) if stage == 3 else 0.0)

    for b in range(n):
        compute(f"fwd{b}", sc.forward_s * share[b] + copy_out(b), "forward", (f"gather{b}",), bucket=b,
                waits_gather=True)
    regather = stage == 3 and setting.reshard
    if regather:  # issued by the pre-backward hook of the first bucket (in backward) whose window holds b
        for b in range(n):
            at = min(first[h] for h in range(b, min(b + setting.prefetch, n - 1) + 1))
            deps = (f"grad{sc.ready_order[at - 1]}",) if at else (f"fwd{n - 1}",)
            comm((1, at, 0, -b), f"regather{b}", ALLGATHER, costs.all_gather(full[b]) + costs.alloc(full[b]), deps, b)
    regathered = {b: copy_out(b) if regather else 0.0 for b in range(n)}
    reduce_kind, reduce_cost = ((ALLREDUCE, costs.all_reduce or sc.allreduce) if stage == 1
                                else (REDUCESCATTER, costs.reduce_scatter))
    done = {b: f"replicate{b}" if costs.replicate else f"reduce{b}" for b in range(n)}  # what a wait waits for
    for b in range(n):
        out = costs.alloc(full[b] / costs.world_size) if stage >= 2 else 0.0  # the reduced shard, new each step
        comm((1, when[b], 1, launches.index(b)), f"reduce{b}", reduce_kind, reduce_cost(full[b]) + out, (f"launch{b}",), b)
        if costs.replicate:
            moved = full[b] if stage == 1 else full[b] // costs.world_size
            comm((1, when[b], 1, launches.index(b), 1), f"replicate{b}", ALLREDUCE, costs.replicate(moved),
                 (f"reduce{b}",), b)
    starts = {first[b]: b for b in range(n)}
    for j, p in enumerate(sc.ready_order):
        deps = (f"regather{owner[p]}",) if regather and starts.get(j) == owner[p] else ()
        # a bucket's first gradient allocates its full gradient buffer (dropped every step)
        alloc = costs.alloc(full[owner[p]]) + regathered[owner[p]] if starts.get(j) == owner[p] else 0.0
        compute(f"grad{p}", grad_s[j] + alloc, "backward", deps, param=p, bucket=owner[p], waits_gather=bool(deps))
        for b in launches:
            if when[b] == j:
                # Stages 2-3 keep one reduce-scatter in flight (commlab/sharded/engine.py, as torch's
                # fully_shard): the training thread waits for the previous one before launching.
                k = launches.index(b)
                prev = (done[launches[k - 1]],) if stage >= 2 and k else ()
                compute(f"launch{b}", sc.bucket_fixed_s, "launch", prev, stretched=False, bucket=b,
                        waits_reduce=bool(prev))
    # stages 1-2: the rank's new rows copied into the next gathers' (fresh) buffers, on the training
    # thread (the step's post-hook launches the first; the forward's pre-hooks the rest)
    copy_in = sum((sc.writeback_s_per_byte * f + costs.alloc(f)) / costs.world_size for f in full) if stage < 3 else 0.0
    compute("optimizer", sc.optimizer_s / costs.world_size + copy_in, "optimizer", tuple(done.values()))
    return tasks + [t for _, t in sorted(chan, key=lambda kt: kt[0])]


def simulate_sharded(costs: ShardedCosts, setting: ShardedSetting) -> tuple[SimResult, list[list[int]]]:
    buckets = sharded_buckets(costs, setting)
    rate = contention_rate(costs.step.kc, costs.step.km, costs.step.lane_gain, comm_kinds=COMM_KINDS)
    return simulate(lower_sharded(costs, setting, buckets), rate), buckets


def sharded_breakdown(result: SimResult, buckets: Sequence[Sequence[int]], costs: ShardedCosts,
                      setting: ShardedSetting) -> tuple[dict, list[dict]]:
    """The sweep's iteration columns plus :data:`SHARDED_COLUMNS`, and one row per reduction.

    Exposed all-gather: the time compute waited on an all-gather (commlab/sharded/timing.py's
    definition, the training thread blocked); exposed reduce-scatter: end of backward compute
    (the last launch) to the optimizer's start, i.e. the wait on the reductions (stage 1's
    all-reduces included), plus the waits for a previous reduce-scatter before launching the next."""
    s, n = result.spans, len(buckets)
    computes = result.by_resource(COMPUTE)
    exposed_ag, waited_rs, previous = 0.0, 0.0, 0.0
    for span in computes:
        if span.meta.get("waits_gather"):
            exposed_ag += max(0.0, span.start - previous)
        if span.meta.get("waits_reduce"):
            waited_rs += max(0.0, span.start - previous)
        previous = span.end
    t0 = s["nosync"].end if "nosync" in s else 0.0  # the step starts with the all-gathers of stages 1-2
    last_compute = max(sp.end for sp in computes if sp.name != "optimizer")
    reduces = [s.get(f"replicate{b}", s[f"reduce{b}"]) for b in range(n)]  # hybrid: the wait ends after both
    comm = result.by_resource(CHANNEL)
    rows = [{"bucket": b, "nbytes": r.meta["nbytes"], "num_params": len(buckets[b]),
             "ready": max(s[f"grad{p}"].end for p in buckets[b]) - t0, "launched": s[f"launch{b}"].start - t0,
             "done": r.end - t0} for b, r in enumerate(reduces)]
    forward_end = s[f"fwd{n - 1}"].end
    exposed_rs = waited_rs + max(0.0, s["optimizer"].start - last_compute)
    row = {"forward": forward_end - t0, "backward_compute": last_compute - forward_end,
           "comm": max(c.end for c in comm) - min(c.start for c in comm),
           "exposed_comm": exposed_ag + exposed_rs, "total": s["optimizer"].start - t0, "write_back": 0.0,
           "unused_allreduce": 0.0, "accumulate_time": t0, "optimizer": s["optimizer"].length,
           "step": s["optimizer"].end}
    extra = {"peak_bytes": peak_bytes(costs, setting, buckets), "comm_bytes": comm_bytes(costs, setting, buckets),
             "exposed_allgather": exposed_ag, "exposed_reducescatter": exposed_rs}
    return {**{c: row[c] for c in STEP_COLUMNS}, **extra}, rows


def peak_bytes(costs: ShardedCosts, setting: ShardedSetting, buckets: Sequence[Sequence[int]]) -> int:
    """Predicted peak bytes per rank: the ZeRO model in fp32 with ``setting.optimizer_bytes`` of
    optimizer state (commlab/sharded/memory_model.py) and bucket_memory's padding, held throughout,
    plus the largest of three moments' transients: inside forward and backward (stage 3's
    gathered buckets, every one without reshard; the full gradient buckets of the reduce-scatters;
    the largest parameter's gradient as autograd makes it, before the copy into its bucket; the
    profile's activations, what autograd saves in one forward, commlab/costmodel/calibration/sharded.py,
    0 in a calibration made without them, freed as backward goes: :func:`backward_peak`), the optimizer's step (its temporaries, of the largest
    parameter's shard) and after it (stages 1-2: the all-gathers then in flight). Left out: the
    allocator's caching and fragmentation, the forward's transient tensors that are not saved, the
    first activations of a stage 1-2 forward beside its last all-gathers, a reduction's own
    temporaries, a p2p algorithm's chunks."""
    from commlab.sharded.memory_model import bucket_memory, step_temporaries, zero_memory  # lazy: imports torch

    w, k = costs.world_size, setting.optimizer_bytes
    full = padded_bytes(costs, buckets)
    unpadded = [sum(costs.step.param_nbytes[p] for p in b) // ELEMENT for b in buckets]
    base = zero_memory(sum(unpadded), w, setting.stage, "fp32", optimizer_bytes=k).total
    m = bucket_memory([f // ELEMENT for f in full], w, setting.stage, setting.prefetch, ELEMENT, int(k), unpadded,
                      input_copy=costs.algorithm == "native", staged=costs.staged_gather)
    gathered = sum(full) if setting.zero.parameters and not setting.reshard else m.gathered
    # autograd's own .grad of a parameter lives until the hook has copied it into the bucket: the
    # largest parameter's bytes at once (DDP's peak counts every .grad already)
    transient = max(costs.step.param_nbytes, default=0)
    during = gathered + backward_peak(costs, setting, buckets, full) + transient
    step = step_temporaries(k) * largest_shard_bytes(costs)
    return int(base + m.padding + max(m.after_step, during, step))


def backward_peak(costs: ShardedCosts, setting: ShardedSetting, buckets: Sequence[Sequence[int]],
                  full: Sequence[int]) -> float:
    """Activations, gradients and gradient buffers alive at once in backward, at their largest, less
    the gradients the held bytes already count. As each bucket's backward starts (in the order
    buckets complete), the activations of the buckets done are freed (in proportion to their
    backward time), their gradients exist (stage 1 the full ones, stages 2-3 the rank's shard; the
    loop's ``zero_grad()`` dropped last step's before forward), and the bucket's gradient buffer
    fills beside the previous one's in flight (stages 2-3). Adding the activations' largest (as
    backward starts) to the buffers' and gradients' (as it ends) counted bytes twice."""
    sc, w = costs.step, costs.world_size
    pos = {p: j for j, p in enumerate(sc.ready_order)}
    grad_s = [t - (sc.ready_s[j - 1] if j else 0.0) for j, t in enumerate(sc.ready_s)]
    back = [sum(grad_s[pos[p]] for p in b) for b in buckets]
    total = sum(back) or 1.0
    grads = [sum(sc.param_nbytes[p] for p in b) if setting.stage == 1 else full[i] / w for i, b in enumerate(buckets)]
    order = sorted(range(len(buckets)), key=lambda b: max(pos[p] for p in buckets[b]))
    peak, done, made = 0.0, 0.0, 0.0
    for i, b in enumerate(order + [None]):
        alive = (full[b] + (full[order[i - 1]] if i else 0)) if b is not None and setting.zero.gradients else 0
        peak = max(peak, costs.activation_bytes * (1 - done / total) + made + alive)
        if b is not None:
            done, made = done + back[b], made + grads[b]
    return peak - sum(grads)


def largest_shard_bytes(costs: ShardedCosts) -> int:
    """Bytes of the largest parameter's piece on the rank holding the most rows (ceil(rows / N))."""
    nbytes, w = costs.step.param_nbytes, costs.world_size
    if costs.rows is None:
        return -(-max(nbytes, default=0) // w)
    return max((-(-r // w) * (n // r) for n, r in zip(nbytes, costs.rows)), default=0)


def comm_bytes(costs: ShardedCosts, setting: ShardedSetting, buckets: Sequence[Sequence[int]]) -> int:
    """Bytes one rank sends per step, counted as the sweep counts what a run sent
    (commlab/runs/traffic.py: the standard accounting of the bandwidth-optimal collectives)."""
    from commlab.runs.traffic import REPLICATE_ALL_REDUCE, hybrid_comm_bytes

    full = padded_bytes(costs, buckets)
    gathers = 2 if setting.zero.parameters and setting.reshard else 1
    reduction = "reduce_scatter" if setting.zero.gradients else "all_reduce"
    # hybrid sharding: each reduction's result (stage 1 the bucket, else the shard) across the replicas
    across = [(REPLICATE_ALL_REDUCE, b if setting.stage == 1 else b // costs.world_size) for b in full]
    kinds = [("all_gather", b) for b in full] * gathers + [(reduction, b) for b in full]
    return int(round(hybrid_comm_bytes(kinds + across, costs.world_size, costs.replicas)))
