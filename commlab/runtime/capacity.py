"""How many CPU ranks this machine can host: refuse a world size that would only thrash.

With Gloo on the CPU every rank computes on the host's cores with its torch threads. Up to
:data:`OVERSUBSCRIPTION` threads per core are allowed, because a DDP rank spends part of each
step waiting on communication (2x runs the default 2-rank grid, and world size 4 with one thread,
on a 2-core laptop). Beyond that a configuration takes minutes and measures the OS scheduler
rather than communication, so it is refused before any process starts.
"""

from __future__ import annotations

from commlab.runtime.metadata import cpu_count

OVERSUBSCRIPTION = 2


def check_cpu_capacity(ranks: int, threads_per_rank: int, cores: int | None = None) -> None:
    """ValueError when ``ranks`` x ``threads_per_rank`` exceeds the cores x OVERSUBSCRIPTION."""
    cores = cpu_count() if cores is None else cores
    need, have = ranks * threads_per_rank, cores * OVERSUBSCRIPTION
    if need > have:
        most = max(0, have // max(1, threads_per_rank))
        raise ValueError(
            f"{ranks} ranks x {threads_per_rank} thread(s) = {need} threads on {cores} CPU core(s): more than "
            f"{OVERSUBSCRIPTION} per core, which would measure the scheduler, not communication. "
            f"At most {most} rank(s) with {threads_per_rank} thread(s) here; use fewer threads, a smaller "
            "world size, or --launcher torchrun --nnodes N across machines"
        )
