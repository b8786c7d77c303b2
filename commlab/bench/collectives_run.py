"""The rank side of `commlab bench collectives`: the driver every collective plug-in runs in.

For each collective (:mod:`commlab.bench.collectives_plugins`), each size: the plug-in's data,
warm-up and timed iterations of each of its algorithms, then the check of every result against
the plug-in's closed form (#wrong).

Fairness on a noisy machine: for one size, each iteration runs every (algorithm, placement)
once, in an order rotated by the iteration number, after a barrier (commlab/runtime/timer.py's loop); so all see the same
background load and none always goes first. Each rank reports its own mean time per
(size, algorithm, placement); the report averages them over ranks, as nccl-tests does.

Placement, as in nccl-tests: "in-place" reduces the buffer itself; "out-of-place" leaves the
input untouched and produces the result in a second buffer. Where an algorithm only works in
place (commlab's all-reduce, like ``dist.all_reduce``), out-of-place costs the copy into the
output buffer plus the in-place run, and both are inside the timed region.

With ``config["stream"]``, rank 0 prints each collective's table header, then each size's rows
as soon as that size is done (the ranks gather their times first), as nccl-tests does, rather
than one table at the end; with ``config["partial"]`` it also keeps them in that CSV, which an
interrupted benchmark saves.
"""

from __future__ import annotations

import time

import pandas as pd
import torch
import torch.distributed as dist

from commlab._atomic import write_via
from commlab.bench.collectives_plugins import Collective
from commlab.bench.collectives_report import PLACEMENTS, combine_ranks, format_rows, header_lines
from commlab.runtime.context import Runtime
from commlab.runtime.timer import Counter, WallClock, rotate, timed_rounds


def run_rank(config: dict) -> list[dict]:
    """Benchmark every (collective, size, algorithm, placement) of ``config`` on this rank.

    ``config["collectives"]`` is a list of (:class:`Collective`, its algorithms); one row per
    (collective, size, algorithm, placement).
    """
    rows, shown = [], []
    for collective, algorithms in config["collectives"]:
        if config.get("stream"):
            _print_header(collective, config)
        for nbytes in config["sizes"]:
            size_rows = _one_size(collective, algorithms, nbytes, config)
            if config.get("stream") and (combined := _gather_rows(size_rows, config)):  # rank 0
                shown += combined
                if config.get("partial"):  # what an interrupted run keeps; before the rows are shown
                    write_via(config["partial"], lambda p: pd.DataFrame(shown).to_csv(p, index=False))
                print(format_rows(pd.DataFrame(combined)), flush=True)
            rows += size_rows
    return rows


def _one_size(c: Collective, algorithms: list[str], nbytes: int, config: dict) -> list[dict]:
    rt = Runtime.current()
    dtype = getattr(torch, config["dtype"])
    element = torch.empty((), dtype=dtype).element_size()
    op = config["op"] if c.reduces else "none"
    count = c.count(nbytes, element, rt.world_size)
    source = c.init(rt.rank, rt.world_size, count, dtype, rt.device)
    buf = torch.empty_like(source)
    pairs = [(a, p) for a in algorithms for p in PLACEMENTS]
    runs = {(a, p): (lambda a=a, p=p: c.run(a, source, buf, config["op"], p)) for a, p in pairs}
    # Process CPU time (user + system, every thread, Gloo's included) beside wall time: on a shared
    # machine it moves far less with other jobs' load than wall time (what a rank spends).
    samples = timed_rounds(runs, config["iters"], config["warmup"], order=rotate,
                           meters={"elapsed": WallClock(buf.device), "cpu": Counter(time.process_time)},
                           # in place starts from the input; out of place overwrites it
                           before=lambda _pair: (buf.copy_(source), dist.barrier()))
    elapsed, cpu = samples["elapsed"], samples["cpu"]
    wrong = dict.fromkeys(pairs, -1)  # -1: not checked
    if config["check"]:
        want = c.expected(rt.rank, rt.world_size, count, dtype, config["op"], rt.device)
        for algorithm, placement in pairs:
            if placement == "in-place":
                buf.copy_(source)
            else:
                buf.zero_()  # out of place must write the whole result (the data are never zero)
            c.run(algorithm, source, buf, config["op"], placement)
            wrong[(algorithm, placement)] = int((c.checked(buf, rt.rank, rt.world_size) != want).sum().item())
    return [{"collective": c.name, "busbw_factor": c.busbw_factor(rt.world_size), "op": op, "root": c.root,
             "size_bytes": count * element, "count": count, "algorithm": algorithm, "placement": placement,
             "mean_s": sum(elapsed[(algorithm, placement)]) / len(elapsed[(algorithm, placement)]),
             "cpu_s": sum(cpu[(algorithm, placement)]) / len(cpu[(algorithm, placement)]),
             "wrong": wrong[(algorithm, placement)]}
            for algorithm, placement in pairs]


def _print_header(c: Collective, config: dict) -> None:
    if dist.get_rank() == 0:
        op = config["op"] if c.reduces else "no op"
        print(f"# {c.name}, {config['dtype']} {op}", flush=True)
        print("\n".join(header_lines()), flush=True)


def _gather_rows(size_rows: list[dict], config: dict) -> list[dict]:
    """One size's rows, every rank's times combined, on rank 0 (all ranks take part; others get [])."""
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, size_rows)
    if dist.get_rank() == 0:
        return combine_ranks(gathered, {"dtype": config["dtype"], "op": config["op"]}).to_dict("records")
    return []
