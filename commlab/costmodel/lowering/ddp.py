"""The DDP bucket life cycle lowered onto the simulator core (commlab/sim): one optimizer step.

One representative rank (ranks are symmetric; the all-reduce couples them, and its calibrated cost
already includes waiting for the slowest) is a host with a ``compute`` resource and one resource
per communication channel (``chan0``, ``chan1``, ...: the round-robin process groups). In the
order the real DDP (commlab/ddp/reducer.py) does things, the compute resource runs::

    [no_sync micro-batches] forward grad(p) ... [launch(k)] ... grad(p) ... writeback(k) ... optimizer

- buckets come from the bucket policy's ``rebuild`` (commlab/ddp/policy.py), what the real DDP
  rebuilds its buckets with after the first iteration, fed the calibrated ready order;
- a gradient's time includes its copy into the bucket (it was profiled inside DDP) and its
  allocation, as profiled: with glibc's heap thresholds fixed in the calibration's and the measured
  ranks alike (commlab/_malloc.py), whether a gradient is fresh pages each step is decided by its
  size alone (at least the mmap threshold), never by the bucket layout, so the profile paid for
  exactly the faults every layout pays;
- bucket k is launched (a compute task of the reducer's fixed cost per bucket) as soon as its last
  gradient is ready and bucket k-1 was launched; with overlap off, all launches follow backward;
- its all-reduce runs on channel k mod groups, after the previous bucket of that channel (on one of
  the channel's ``lanes`` in turn: Gloo runs two queued native all-reduces at once);
- the end of backward writes buckets back in order, each once its all-reduce is done;
- while compute and communication run at once, compute advances at 1/(1+kc) and communication
  at 1/(1+km); concurrent channels and lanes share one link, at ``lane_gain`` times one
  collective's aggregate speed when more than one runs (measured, not assumed: by size, from
  buckets queued on distinct buffers as overlap-off DDP queues them, commlab/costmodel/calibration/queueing.py);
- a write-back (a memory copy) beside a collective uses its own pair of factors, measured with a
  copy against the all-reduce (commlab/costmodel/calibration/queueing.py), where calibration has them;
- the model's compute is stretched by the co-run factor when more than one rank computes; the
  optimizer step and the write-back, which stream memory rather than compute, by their own co-run
  factors where calibration measured them (the optimizer otherwise by the compute's, the
  write-back otherwise not at all, as before they were measured).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from typing import Any

from commlab.costmodel.lowering.buckets import DEFAULT_POLICY, assign, bucket_tasks
from commlab.costmodel.terms.costs import DDPProfile, SystemCosts
from commlab.sim import SimResult, Task, simulate
from commlab.runs.store import STEP_COLUMNS

COMPUTE = "compute"
COMM_KINDS = ("allreduce",)
COPY_KINDS = ("writeback",)  # memory copies: their own contention where calibration measured it


@dataclass(frozen=True)
class StepCosts(DDPProfile):
    """Every cost the lowering needs for one workload on one algorithm and world size, in seconds:
    the workload's DDPProfile with the :class:`~commlab.costmodel.terms.costs.SystemCosts` terms of that
    algorithm and world size bound to it by :func:`step_costs`."""

    writeback_s_per_byte: float
    bucket_fixed_s: float
    corun: float  # compute stretch when every rank computes at once (1 on one rank)
    kc: float
    km: float
    allreduce: Callable[[int], float]  # bytes -> seconds, for this algorithm and world size
    # Collectives one channel runs at once, and their aggregate speed (costs.Contention).
    lanes: int = 1
    lane_gain: float = 1.0
    lane_gain_at: Callable[[float], float] | None = None  # bytes -> gain, where measured by size
    # the write-back's copies beside a collective (costs.Contention); None: kc / km
    kc_copy: float | None = None
    km_copy: float | None = None
    activation_bytes: int = 0  # what forward keeps for backward, where calibration measured it (peak bytes)
    # the optimizer's and the write-back's stretches when every rank runs them at once (memory-bound:
    # more than the compute's); None: the optimizer takes ``corun``, the write-back is not stretched
    corun_optimizer: float | None = None
    corun_copy: float | None = None

    def optimizer_stretch(self) -> float:
        return self.corun if self.corun_optimizer is None else self.corun_optimizer

    def copy_stretch(self) -> float:
        return 1.0 if self.corun_copy is None else self.corun_copy


def step_costs(system: SystemCosts, profile: DDPProfile, algorithm: str, world_size: int,
               activation_bytes: int = 0) -> StepCosts:
    """The lowering's costs of one workload on one algorithm and world size (ValueError if the
    system has no all-reduce cost for them). One rank has no co-run stretch (none of the three)."""
    c, o = system.contention_of(algorithm), system.overheads
    table = system.collective("allreduce", algorithm, world_size)
    return StepCosts(
        **{f.name: getattr(profile, f.name) for f in fields(DDPProfile)},
        writeback_s_per_byte=o.writeback_s_per_byte, bucket_fixed_s=o.bucket_fixed_s,
        corun=system.corun if world_size > 1 else 1.0, kc=c.kc, km=c.km,
        allreduce=table, lanes=c.lanes, lane_gain=c.lane_gain,
        lane_gain_at=(lambda n: c.gain_at(n, table(n))) if c.paired is not None else None,
        kc_copy=c.kc_copy, km_copy=c.km_copy, activation_bytes=int(activation_bytes),
        corun_optimizer=system.corun_optimizer if world_size > 1 else None,
        corun_copy=system.corun_copy if world_size > 1 else None)


@dataclass(frozen=True)
class DDPSetting:
    """The knobs of one configuration that change the timeline."""

    bucket_cap_mb: float | None = None  # None: torch's 25 MiB and its 1 MiB first bucket
    first_bucket_mb: float | None = None
    overlap: bool = True
    accumulate: int = 1
    groups: int = 1
    policy: Any = DEFAULT_POLICY  # a bucket policy's name or instance (commlab/ddp/policy.py)

    def __post_init__(self) -> None:
        if self.accumulate < 1 or self.groups < 1:
            raise ValueError(f"accumulate and groups must be >= 1, got {self.accumulate}, {self.groups}")


def assign_buckets(costs: StepCosts, setting: DDPSetting) -> list[list[int]]:
    """The rebuilt buckets (reduction order), from the bucket policy the real DDP uses."""
    return assign(costs.param_nbytes, costs.ready_order, policy=setting.policy,
                  bucket_cap_mb=setting.bucket_cap_mb, first_bucket_mb=setting.first_bucket_mb)


def lower(costs: StepCosts, setting: DDPSetting, buckets: Sequence[Sequence[int]]) -> list[Task]:
    """The task graph of one optimizer step (see the module docstring)."""
    if len(costs.ready_s) != len(costs.ready_order):
        raise ValueError("ready_s and ready_order must have one entry per parameter")
    host, stretch = "rank", costs.corun
    tasks: list[Task] = []

    def compute(name: str, seconds: float, kind: str, deps: tuple[str, ...] = (), stretch: float = stretch,
                **meta) -> None:
        # Each part by the co-run factor measured on its own kind of work: forward+backward's
        # stretches the model's work; the launch (tiny, timed inside DDP on one rank) none.
        tasks.append(Task(name, COMPUTE, max(seconds, 0.0) * stretch, deps, kind, host, meta=meta))

    if setting.accumulate > 1:
        compute("nosync", (setting.accumulate - 1) * costs.nosync_s, "nosync")
    compute("forward", costs.forward_s, "forward")
    position = {p: j for j, p in enumerate(costs.ready_order)}
    nbytes = [sum(costs.param_nbytes[p] for p in b) for b in buckets]
    # Launch point of bucket k: after the gradient that completes it, and not before bucket k-1.
    launch_after: list[int] = []
    for b in buckets:
        last = max(position[p] for p in b)
        launch_after.append(max(last, launch_after[-1]) if launch_after else last)
    if not setting.overlap:
        launch_after = [len(costs.ready_order) - 1] * len(buckets)
    channels = [f"chan{k % setting.groups}" for k in range(len(buckets))]
    if costs.lanes > 1:
        channels = [c + f".{(k // setting.groups) % costs.lanes}" for k, c in enumerate(channels)]
    reduce = bucket_tasks(nbytes, costs.allreduce, channel=channels, host=host,
                          launched_by=[f"launch{k}" for k in range(len(buckets))])
    k = 0
    previous = 0.0
    for j, p in enumerate(costs.ready_order):
        compute(f"grad{p}", costs.ready_s[j] - previous, "backward", param=p)
        previous = costs.ready_s[j]
        while k < len(buckets) and launch_after[k] == j:
            compute(f"launch{k}", costs.bucket_fixed_s, "launch", stretch=1.0, bucket=k)
            tasks.append(reduce[k])
            k += 1
    for k, size in enumerate(nbytes):
        compute(f"writeback{k}", costs.writeback_s_per_byte * size, "writeback", (f"allreduce{k}",),
                stretch=costs.copy_stretch(), bucket=k)
    compute("optimizer", costs.optimizer_s, "optimizer", stretch=costs.optimizer_stretch())
    return tasks


def contention_rate(kc: float, km: float, lane_gain: float = 1.0,
                    comm_kinds: Sequence[str] = COMM_KINDS,
                    gain_at: Callable[[float], float] | None = None,
                    copy: tuple[float | None, float | None] = (None, None),
                    copy_kinds: Sequence[str] = COPY_KINDS) -> Callable[[Task, Sequence[Task]], float]:
    """The fluid model's speeds: compute 1/(1+kc) beside communication, communication 1/(1+km)
    beside compute and gain/n among n concurrent collectives (gain 1 alone, lane_gain beside others,
    or ``gain_at`` of the collective's bytes where the gain was measured by size). Tasks of
    ``copy_kinds`` (memory copies: the write-back) use ``copy`` = (kc, km) where measured.
    ``comm_kinds``: the task kinds that are collectives (the sharded lowering has three)."""
    kc_copy = kc if copy[0] is None else copy[0]
    km_copy = km if copy[1] is None else copy[1]

    def rate(task: Task, others: Sequence[Task]) -> float:
        comm = [o for o in others if o.kind in comm_kinds]
        if task.kind in comm_kinds:
            beside = [o for o in others if o.kind not in comm_kinds]
            # one compute task runs at a time on the host: it is a copy or the model's work
            slow = 1.0 + (km_copy if all(o.kind in copy_kinds for o in beside) else km) if beside else 1.0
            gain = (gain_at(task.meta["nbytes"]) if gain_at and "nbytes" in task.meta else lane_gain) if comm else 1.0
            return gain / (slow * (1 + len(comm)))
        return 1.0 / (1.0 + (kc_copy if task.kind in copy_kinds else kc)) if comm else 1.0

    return rate


def simulate_step(costs: StepCosts, setting: DDPSetting) -> tuple[SimResult, list[list[int]]]:
    buckets = assign_buckets(costs, setting)
    tasks = lower(costs, setting, buckets)
    rate = contention_rate(costs.kc, costs.km, costs.lane_gain, gain_at=costs.lane_gain_at,
                           copy=(costs.kc_copy, costs.km_copy))
    return simulate(tasks, rate), buckets


def breakdown(result: SimResult, buckets: Sequence[Sequence[int]], costs: StepCosts) -> tuple[dict, list[dict]]:
    """The sweep's iteration columns and bucket rows (commlab/ddp/timing.py's definitions),
    relative to the synchronised forward's start as a measured run records them."""
    s = result.spans
    t0 = s["forward"].start
    position = {p: j for j, p in enumerate(costs.ready_order)}
    rows = []
    for k, b in enumerate(buckets):
        last = max(b, key=lambda p: position[p])
        rows.append({"bucket": k, "nbytes": s[f"allreduce{k}"].meta["nbytes"], "num_params": len(b),
                     "ready": s[f"grad{last}"].end - t0, "launched": s[f"launch{k}"].start - t0,
                     "done": s[f"allreduce{k}"].end - t0})
    forward = s["forward"].end - t0
    last_ready = max(r["ready"] for r in rows)
    total = s[f"writeback{len(buckets) - 1}"].end - t0  # write-backs run in order: the last ends last
    row = {"forward": forward, "backward_compute": last_ready - forward,
           "comm": max(r["done"] for r in rows) - min(r["launched"] for r in rows),
           # timing.py's definition: end of backward compute -> last bucket done (the write-back
           # after it is its own column), 0 when backward hid every bucket
           "exposed_comm": max(0.0, max(r["done"] for r in rows) - last_ready), "total": total,
           "write_back": sum(s[f"writeback{k}"].length for k in range(len(buckets))),
           "unused_allreduce": 0.0,  # the lowered step has no find_unused_parameters flag all-reduce
           "accumulate_time": t0, "optimizer": s["optimizer"].length, "step": s["optimizer"].end}
    return {c: row[c] for c in STEP_COLUMNS}, rows  # the sweep's columns, in its order (KeyError if one is missing)
