"""The rank side of what sharded predictions add to calibration: collective tables, activations.

Run inside :func:`commlab.costmodel.calibration.measure.calibrate_rank` when the spec names sharded
algorithms: for each algorithm of commlab/sharded/comm.py and each size (the full bucket, padded
to a multiple of the world size as commlab/sharded/layout.py pads it), the median of ``iters``
calls, each after a barrier, through the same functions the sharded wrapper calls, so a table
prices exactly what a bucket's collective costs. An algorithm that refuses the world size (say,
one that needs a power of two) raises on every rank alike before communicating, and is left out.

:func:`activation_bytes` measures what a forward keeps for backward, for the predicted peak.
"""

from __future__ import annotations

import statistics

import torch
import torch.distributed as dist

from commlab.costmodel.calibration.devicetime import clock_for, collective_timer
from commlab.runs.traffic import REPLICATE_ALL_REDUCE
from commlab.runtime.timer import time_collective
from commlab.sharded import comm


def time_sharded(algorithms: list[str], sizes: list[int], iters: int,
                 device: torch.device = torch.device("cpu"), group=None,
                 kinds: tuple[str, ...] = ("reduce_scatter", "all_gather")) -> dict[str, dict[str, list[float]]]:
    """{"reduce_scatter": {algorithm: [median seconds per size]}, "all_gather": {...}} on this rank,
    over ``group`` (None: the world; every group of the world runs at once, from one barrier);
    ``kinds`` may add "all_reduce" (hybrid sharding's stage 1, within a shard group)."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    clock = clock_for(device)
    out: dict[str, dict[str, list[float]]] = {kind: {} for kind in kinds}
    for algorithm in algorithms:
        try:
            tables: dict[str, list[float]] = {kind: [] for kind in kinds}
            for nbytes in sizes:
                numel = -(-max(nbytes // 4, world) // world) * world
                full = torch.ones(numel, dtype=torch.float32, device=device)
                shard = torch.empty(numel // world, dtype=torch.float32, device=device)
                own = full[rank * (numel // world):(rank + 1) * (numel // world)]
                calls = {"reduce_scatter": lambda: comm.reduce_scatter(shard, full, group, algorithm).wait(),
                         # stages 1-2 gather in place from the own block of the flat buffer (comm.all_gather)
                         "all_gather": lambda: comm.all_gather(full, own, group, algorithm).wait(),
                         "all_reduce": lambda: comm.all_reduce(full, group, algorithm).wait()}
                for kind in kinds:
                    tables[kind].append(_median(clock, iters, calls[kind], device))
        except ValueError:
            continue
        for kind in kinds:
            out[kind][algorithm] = tables[kind]
    return out


def shard_sizes(world: int) -> list[int]:
    """The shard group sizes hybrid sharding can use on ``world`` ranks: the divisors from 2 to world / 2."""
    return [s for s in range(2, world // 2 + 1) if world % s == 0]


def time_hybrid(algorithms: list[str], sizes: list[int], iters: int,
                device: torch.device = torch.device("cpu")) -> dict[str, dict[str, dict[str, list[float]]]]:
    """For each shard group size (:func:`shard_sizes`), by str(size): the shard groups' reduce-scatter,
    all-gather and all-reduce, and the all-reduce across the replicas ("replicate_all_reduce"), each
    with every group of its kind running at once, as in a hybrid step (commlab.Topology's layout:
    shard groups are consecutive ranks). Collective: every rank creates every group."""
    world, rank = dist.get_world_size(), dist.get_rank()
    out = {}
    for s in shard_sizes(world):
        shard_groups = [dist.new_group(list(range(g * s, (g + 1) * s))) for g in range(world // s)]
        replica_groups = [dist.new_group(list(range(j, world, s))) for j in range(s)]
        mine = time_sharded(algorithms, sizes, iters, device, shard_groups[rank // s],
                            ("reduce_scatter", "all_gather", "all_reduce"))
        across = time_sharded(algorithms, sizes, iters, device, replica_groups[rank % s], ("all_reduce",))
        out[str(s)] = {**mine, REPLICATE_ALL_REDUCE: across["all_reduce"]}
    return out


def fresh_memory(sizes: list[int], iters: int, device: torch.device = torch.device("cpu")) -> list[float]:
    """Seconds to allocate ``nbytes`` anew and write them once, beyond writing a buffer already
    held, per size: what the sharded engine pays each step for the buffers it allocates again
    (stage 3's gathered parameters, every stage's gradient buckets and reduced shards). On CPU a
    block above glibc's mmap threshold comes back from the kernel as fresh pages, each faulted on
    first write; held or small blocks cost nothing here. Measured on every rank at once, as
    the ranks fault at once in a step."""
    clock = clock_for(device)
    out = []
    for nbytes in sizes:
        numel = max(nbytes // 4, 1)
        held = torch.empty(numel, dtype=torch.float32, device=device)
        held.fill_(1.0)
        reuse = _median(clock, iters, lambda: held.fill_(1.0))
        fresh = _median(clock, iters, lambda: torch.empty(numel, dtype=torch.float32, device=device).fill_(1.0))
        out.append(max(fresh - reuse, 0.0))
    return out


def _median(clock, iters: int, call, device: torch.device | None = None) -> float:
    """The median of ``iters`` calls after one that warms the buffers and the backend's pairs up:
    each from a barrier, or for a collective on a GPU queued back to back (devicetime.py's
    collective_timer, which says why)."""
    each = time_collective if device is None else collective_timer(device, clock)
    return float(statistics.median(each(call, iters, clock=clock)))


def activation_bytes(model: torch.nn.Module, loss_fn, batch) -> int:
    """Bytes of the tensors autograd saves for backward in one forward (the hooks of
    torch.autograd.graph.saved_tensors_hooks see every one), each storage counted once and the
    parameters' own left out: they are in the memory model already. The input a first layer
    saves is counted."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = loss_fn(model(batch[0]), batch[1])
    loss.backward()
    model.zero_grad(set_to_none=True)
    return int(sum(saved.values()))
