"""How many local ranks this machine can host: refuse a world size that would only thrash.

Cores: with Gloo on the CPU every rank computes on the host's cores with its torch threads. Up
to :data:`OVERSUBSCRIPTION` threads per core are allowed, because a rank spends part of each
step waiting on communication (2x runs the default 2-rank grid, and world size 4 with one thread,
on a 2-core laptop). Beyond that a configuration takes minutes and measures the OS scheduler
rather than communication, so it is refused before any process starts.

Memory: every rank is a process holding torch and a process group, at least
:data:`RANK_BASE_BYTES` of its own memory, plus its data. More than the memory available would
not run slowly but end in the kernel's out-of-memory killer, so there is no factor for it.

Both checks are the sweep's and the benchmarks'; the benchmarks' ``--oversubscribe`` skips them.
"""

from __future__ import annotations

from commlab.runtime.metadata import cpu_count

OVERSUBSCRIPTION = 2
# A CPU rank with torch imported and a Gloo group held ~145 MiB of anonymous (its own) memory on
# torch 2.13 (RssAnon in /proc/self/status); 128 MiB is a floor, not an estimate.
RANK_BASE_BYTES = 128 << 20


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
            "world size, or several machines (sweep --launcher torchrun --nnodes N)"
        )


def check_memory_capacity(ranks: int, data_bytes_per_rank: int = 0, available: int | None = None) -> None:
    """ValueError when ``ranks`` x (RANK_BASE_BYTES + data) exceeds the memory available now."""
    available = available_memory() if available is None else available
    if available is None:
        return  # not Linux: nothing to compare with
    per_rank = RANK_BASE_BYTES + data_bytes_per_rank
    if ranks * per_rank > available:
        raise ValueError(
            f"{ranks} ranks x at least {per_rank / 2**20:.0f} MiB each = {ranks * per_rank / 2**30:.1f} GiB, more than "
            f"the {available / 2**30:.1f} GiB of memory available: the ranks would be killed by the kernel's "
            f"out-of-memory killer. At most {available // per_rank} rank(s) here"
        )


def check_local_ranks(ranks: int, threads_per_rank: int, data_bytes_per_rank: int = 0) -> None:
    """Both checks for ``ranks`` local CPU ranks (ValueError naming the first that fails)."""
    check_cpu_capacity(ranks, threads_per_rank)
    check_memory_capacity(ranks, data_bytes_per_rank)


def available_memory() -> int | None:
    """MemAvailable of /proc/meminfo in bytes (what can be allocated without swapping), or None."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None
