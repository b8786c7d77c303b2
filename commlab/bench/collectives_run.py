"""The rank side of `commlab bench collectives`: data, interleaved timing loop, result check.

Data follow nccl-tests' idea of values whose reduction is exact in every dtype: rank r holds
(r + 1) * (i % 5 + 1) at index i, so sums stay small integers (exact even in bfloat16 up to 8
ranks) and every algorithm's result can be compared for equality with a closed form.

Fairness on a noisy machine: for one size, each iteration runs every algorithm once, in an
order rotated by the iteration number, after a barrier; so all algorithms see the same
background load and none always goes first. Each rank reports its own mean time per
(size, algorithm); the driver keeps the slowest rank's, as nccl-tests does.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from commlab import collectives
from commlab.runtime.context import Runtime


def bench_input(rank: int, count: int, dtype: torch.dtype, device) -> torch.Tensor:
    pattern = torch.arange(count, device=device) % 5 + 1
    return (pattern * (rank + 1)).to(dtype)


def expected_result(world: int, count: int, dtype: torch.dtype, op: str, device) -> torch.Tensor:
    pattern = torch.arange(count, device=device, dtype=torch.int64) % 5 + 1
    total = pattern * (world * (world + 1) // 2)
    if op == "sum":
        out = total
    elif op == "max":
        out = pattern * world
    elif op == "min":
        out = pattern
    elif dtype.is_floating_point:  # avg: (world + 1) / 2 * pattern, a multiple of 1/2: exact
        return (total.double() / world).to(dtype)
    else:
        out = torch.div(total, world, rounding_mode="floor")
    return out.to(dtype)


def run_rank(config: dict) -> list[dict]:
    """Benchmark every (size, algorithm) of ``config`` on this rank; one row per pair."""
    rt = Runtime.current()
    dtype = getattr(torch, config["dtype"])
    element = torch.empty((), dtype=dtype).element_size()
    algorithms, op = config["algorithms"], config["op"]
    rows = []
    for nbytes in config["sizes"]:
        count = nbytes // element
        source = bench_input(rt.rank, count, dtype, rt.device)
        buf = torch.empty_like(source)
        elapsed = {a: [] for a in algorithms}
        for it in range(config["warmup"] + config["iters"]):
            shift = it % len(algorithms)
            for algorithm in algorithms[shift:] + algorithms[:shift]:
                buf.copy_(source)
                dist.barrier()
                start = time.perf_counter()
                collectives.all_reduce(buf, op, algorithm=algorithm)
                if buf.is_cuda:
                    torch.cuda.synchronize(buf.device)
                if it >= config["warmup"]:
                    elapsed[algorithm].append(time.perf_counter() - start)
        wrong = dict.fromkeys(algorithms, -1)  # -1: not checked
        if config["check"]:
            want = expected_result(rt.world_size, count, dtype, op, rt.device)
            for algorithm in algorithms:
                buf.copy_(source)
                collectives.all_reduce(buf, op, algorithm=algorithm)
                wrong[algorithm] = int((buf != want).sum().item())
        for algorithm in algorithms:
            rows.append({
                "size_bytes": count * element,
                "count": count,
                "algorithm": algorithm,
                "mean_s": sum(elapsed[algorithm]) / len(elapsed[algorithm]),
                "wrong": wrong[algorithm],
            })
    return rows
