"""DDP's end of backward, measured: buckets queued on a process group at once, and the write-back.

Run inside :func:`commlab.costmodel.calibration.measure.calibrate_rank` on Gloo (native algorithm, more than
one rank). With overlap off, DDP hands every bucket to the process group at the end of backward;
Gloo's process group runs them on its two worker threads (ProcessGroupGloo::Options, threads=2),
two at a time, each on its own bucket buffer. How fast that goes is not what one pair on two warm
buffers said: on this 2-core machine (2026-11) two 4 MiB all-reduces together came out 1.47x as
fast as one after the other, while twelve queued on twelve buffers (what DDP does) ran at 1.0x
the barrier-timed table, twelve 1 MiB ones at 0.8x and three 16 MiB ones at 1.3x.

So for every size of the calibration table, :func:`queued` times ``k`` distinct buffers of that
size (about the model's gradient bytes in all, 2 to 16 of them) issued asynchronously at once
and waited for in order, after a barrier; :func:`paired_seconds` turns that into a table of its
own, the time per collective while two run at once, which the lowering holds against the
barrier-timed table to price two lanes at any size (commlab/costmodel/terms/costs.py's
``Contention.gain_at``).

While later buckets are still reduced, the end of backward copies the reduced ones back into
``.grad``: :func:`copy_contention` measures a copy beside an all-reduce, for the fluid model's
factors of that pair (the write-back's own, apart from forward+backward's), as
:func:`alone_and_together` measures every such pair.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

from commlab.runtime.timer import time_collective

MAX_QUEUE = 16


def queue_length(nbytes: int, total_bytes: int) -> int:
    """Buffers of ``nbytes`` queued at once: about the model's gradient bytes, 2 to MAX_QUEUE (pure)."""
    return int(min(max(round(total_bytes / max(nbytes, 1)), 2), MAX_QUEUE))


def queued(sizes: list[int], total_bytes: int, reps: int, algorithm: str = "native") -> dict[str, list]:
    """{"sizes", "k", "queued_s"}: median seconds (on this rank) to get through ``k`` all-reduces of
    each size issued at once on distinct buffers; the first round of each size is a warm-up."""
    import torch  # lazy: calibration's pure side (gains) is imported where torch is not

    from commlab import collectives

    out: dict[str, list] = {"sizes": [], "k": [], "queued_s": []}
    for nbytes in sizes:
        k = queue_length(nbytes, total_bytes)
        bufs = [torch.ones(max(nbytes // 4, 1), dtype=torch.float32) for _ in range(k)]

        def issue_all(bufs=bufs) -> None:  # bound now: the buffers are freed before the next size
            handles = [collectives.all_reduce(b, "sum", algorithm=algorithm, async_op=True) for b in bufs]
            for h in handles:
                h.wait()

        samples = time_collective(issue_all, reps)
        out["sizes"].append(int(nbytes))
        out["k"].append(k)
        out["queued_s"].append(float(statistics.median(samples)))
        del bufs
    return out


def paired_seconds(table_s: list[float], k: list[int], queued_s: list[float]) -> list[float]:
    """Seconds per collective while two run at once, at each size (pure): the queue's time less an
    odd last one's (alone: the table's time), over the calls that ran paired. A queue faster
    than twice as fast as the table is held at that (two at once cannot beat two lanes)."""
    if not (len(table_s) == len(k) == len(queued_s)):
        raise ValueError("paired_seconds: one table time, queue length and queued time per size")
    out = []
    for t, n, q in zip(table_s, k, queued_s):
        paired = (q - (n % 2) * t) / (n - n % 2)
        out.append(max(paired, t / 2))
    return out


def copy_contention(nbytes: int, reps: int, algorithm: str = "native") -> dict[str, float]:
    """A bucket's write-back (a memory copy into ``.grad``) and an all-reduce of ``nbytes``, alone
    and started together: the fluid model's factors for what DDP's end of backward does while
    later buckets are still reduced. A copy and a collective both stream memory, unlike the
    model's matrix products, so they slow each other otherwise than forward+backward does
    (the queue of three 16 MiB buckets here took 34 ms bare and 46 ms with the copies between
    the waits, 2026-11). The copies repeat until they last about as long as the collective."""
    import torch

    from commlab import collectives
    from commlab.costmodel.calibration.devicetime import clock_for

    src, dst, buf = (torch.ones(max(nbytes // 4, 1), dtype=torch.float32) for _ in range(3))
    reduce = lambda: collectives.all_reduce(buf, "sum", algorithm=algorithm)  # noqa: E731
    one_copy = statistics.median(time_collective(lambda: dst.copy_(src), 3, warmup=0))
    one_reduce = statistics.median(time_collective(reduce, 2, warmup=0))
    copies = max(1, min(round(one_reduce / max(one_copy, 1e-6)), 64))
    copy = lambda: [dst.copy_(src) for _ in range(copies)]  # noqa: E731
    return {**alone_and_together(algorithm, buf, copy, reps, clock_for(buf.device)), "nbytes": nbytes, "copies": copies}


def alone_and_together(algorithm: str, buf, compute, reps: int, clock, side=None) -> dict[str, float]:
    """The fluid model's raw figures for ``compute`` beside an all-reduce of ``buf``: medians over
    ``reps`` of each alone, then of both started together (:func:`together`), each from a barrier."""
    import torch.distributed as dist

    from commlab import collectives

    reduce = lambda: collectives.all_reduce(buf, "sum", algorithm=algorithm)  # noqa: E731
    alone_c, alone_m, both_c, both_m = [], [], [], []
    for _ in range(reps):
        alone_c += time_collective(compute, 1, warmup=0, clock=clock)
        alone_m += time_collective(reduce, 1, warmup=0, clock=clock)
        dist.barrier()
        c, m = together(algorithm, buf, compute, clock, side)
        both_c.append(c)
        both_m.append(m)
    med = lambda xs: float(statistics.median(xs))  # noqa: E731
    return {"compute_alone_s": med(alone_c), "comm_alone_s": med(alone_m), "compute_both_s": med(both_c),
            "comm_both_s": med(both_m)}


def together(algorithm: str, buf, compute, clock, side=None) -> tuple[float, float]:
    """(compute, collective) seconds of an all-reduce started with the compute, from one start.

    Where the collective's end is stamped is the clock's business: on the CPU the host is busy
    computing, so its end is the time its future's callback ran (on the worker thread); on a GPU
    it runs on a side stream, and its end is an event recorded there after waiting for it."""
    import torch

    from commlab import collectives

    start = clock.stamp()
    if side is None:
        done: list[Any] = []
        handle = collectives.all_reduce(buf, "sum", algorithm=algorithm, async_op=True)
        handle.get_future().then(lambda _f: done.append(clock.stamp()))
        compute()
        compute_end = clock.stamp()
        handle.wait()
        deadline = time.monotonic() + 60
        while not done and time.monotonic() < deadline:  # the callback runs on the worker thread
            time.sleep(0.0005)
        end = done[0] if done else clock.stamp()
    else:
        side.wait_stream(torch.cuda.current_stream(buf.device))  # starts after `start`
        with torch.cuda.stream(side):
            handle = collectives.all_reduce(buf, "sum", algorithm=algorithm, async_op=True)
        compute()
        compute_end = clock.stamp()
        with torch.cuda.stream(side):
            handle.wait()
            end = clock.stamp(side)
    return clock.seconds(start, compute_end), clock.seconds(start, end)
