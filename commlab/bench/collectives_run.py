"""The rank side of `commlab bench collectives`: data, interleaved timing loop, result check.

Data follow nccl-tests' idea of values whose reduction is exact in every dtype: rank r holds
(r + 1) * (i % 5 + 1) at index i, so sums stay small integers (exact even in bfloat16 up to 8
ranks) and every algorithm's result can be compared for equality with a closed form.

Fairness on a noisy machine: for one size, each iteration runs every (algorithm, placement)
once, in an order rotated by the iteration number, after a barrier; so all see the same
background load and none always goes first. Each rank reports its own mean time per
(size, algorithm, placement); the report averages them over ranks, as nccl-tests does.

Placement, as in nccl-tests: "in-place" reduces the buffer itself; "out-of-place" leaves the
input untouched and produces the result in a second buffer. commlab's all-reduce (like
``dist.all_reduce``) works in place, so out-of-place costs the copy into the output buffer
plus the in-place all-reduce, and both are inside the timed region.

With ``config["stream"]``, rank 0 prints each size's rows as soon as that size is done (the
ranks gather their times first), as nccl-tests does, rather than one table at the end.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from commlab import collectives
from commlab.bench.collectives_report import PLACEMENTS
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




def _all_reduce(source, out, op, algorithm, placement):
    """In place: reduce ``out`` (already holding the input). Out of place: copy, then reduce."""
    if placement == "out-of-place":
        out.copy_(source)
    collectives.all_reduce(out, op, algorithm=algorithm)


def run_rank(config: dict) -> list[dict]:
    """Benchmark every (size, algorithm, placement) of ``config`` on this rank; one row each."""
    rt = Runtime.current()
    dtype = getattr(torch, config["dtype"])
    element = torch.empty((), dtype=dtype).element_size()
    algorithms, op = config["algorithms"], config["op"]
    pairs = [(a, p) for a in algorithms for p in PLACEMENTS]
    rows = []
    for nbytes in config["sizes"]:
        count = nbytes // element
        source = bench_input(rt.rank, count, dtype, rt.device)
        buf = torch.empty_like(source)
        elapsed = {pair: [] for pair in pairs}
        cpu = {pair: [] for pair in pairs}  # this process's CPU time, all threads (Gloo's included)
        for it in range(config["warmup"] + config["iters"]):
            shift = it % len(pairs)
            for algorithm, placement in pairs[shift:] + pairs[:shift]:
                buf.copy_(source)  # in place starts from the input; out of place overwrites it
                dist.barrier()
                # Process CPU time (user + system, every thread, Gloo's included): on a shared
                # machine it moves far less with other jobs' load than wall time (what a rank spends).
                cpu_start = time.process_time()
                start = time.perf_counter()
                _all_reduce(source, buf, op, algorithm, placement)
                if buf.is_cuda:
                    torch.cuda.synchronize(buf.device)
                if it >= config["warmup"]:
                    elapsed[(algorithm, placement)].append(time.perf_counter() - start)
                    cpu[(algorithm, placement)].append(time.process_time() - cpu_start)
        wrong = dict.fromkeys(pairs, -1)  # -1: not checked
        if config["check"]:
            want = expected_result(rt.world_size, count, dtype, op, rt.device)
            for algorithm, placement in pairs:
                if placement == "in-place":
                    buf.copy_(source)
                else:
                    buf.zero_()  # out of place must overwrite the whole output
                _all_reduce(source, buf, op, algorithm, placement)
                wrong[(algorithm, placement)] = int((buf != want).sum().item())
        size_rows = [{"size_bytes": count * element, "count": count, "algorithm": algorithm, "placement": placement,
                      "mean_s": sum(elapsed[(algorithm, placement)]) / len(elapsed[(algorithm, placement)]),
                      "cpu_s": sum(cpu[(algorithm, placement)]) / len(cpu[(algorithm, placement)]),
                      "wrong": wrong[(algorithm, placement)]}
                     for algorithm, placement in pairs]
        if config.get("stream"):
            _print_rows(size_rows, config)
        rows += size_rows
    return rows


def _print_rows(size_rows: list[dict], config: dict) -> None:
    """Rank 0 prints one size's table rows, every rank's times combined (all ranks take part)."""
    from commlab.bench.collectives_report import combine_ranks, format_rows

    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, size_rows)
    if dist.get_rank() == 0:
        df = combine_ranks(gathered, {"dtype": config["dtype"], "op": config["op"]})
        print(format_rows(df), flush=True)
