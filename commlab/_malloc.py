"""glibc's heap thresholds fixed, so that where malloc happens to place a block does not decide a timing.

Used by the benchmarks (``commlab bench ddp``, ``bench sharded``) and by the pipeline planner's
calibration and ``--validate`` ranks: whatever compares or predicts times runs with them fixed.
"""

from __future__ import annotations


def keep_freed_memory() -> bool:
    """glibc only: keep freed heap memory in the process instead of returning it to the system.

    Both DDPs get fresh gradients from autograd every iteration (``zero_grad()`` sets them to
    None), the same allocations in the same sizes. Whether they page-fault is decided by where
    glibc placed them: freed chunks at the top of the heap are trimmed (``M_TRIM_THRESHOLD``) and
    large ones are mmapped (``M_MMAP_THRESHOLD``). Measured on this harness: the implementation
    that runs first in iteration 0 is the one whose gradients land at the top of the heap and
    fault ~12,000 times per iteration, whichever it is. Fixed thresholds take that placement
    luck out of the comparison; ``--glibc-trim`` keeps glibc's default (dynamic) behaviour.
    """
    import ctypes

    try:
        libc = ctypes.CDLL("libc.so.6")
        m_trim_threshold, m_mmap_threshold = -1, -3  # from glibc's malloc.h
        # 32 MiB is the largest mmap threshold glibc accepts on 64-bit (DEFAULT_MMAP_THRESHOLD_MAX).
        return bool(libc.mallopt(m_mmap_threshold, 32 << 20) and libc.mallopt(m_trim_threshold, 1 << 30))
    except (OSError, AttributeError):  # not glibc
        return False
