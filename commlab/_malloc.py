"""glibc's heap thresholds fixed, so that where malloc happens to place a block does not decide a timing.

Used by the benchmarks (``commlab bench ddp``, ``bench sharded``), the sweep's ranks
(commlab/sweep/worker.py), the DDP calibration's ranks (commlab/costmodel/calibration/measure.py) and the
pipeline planner's calibration and ``--validate`` ranks: whatever compares or predicts times runs
with them fixed, so that the calibration's allocations behave as the measured runs' do.

With them fixed the placement is a rule of sizes alone: a block of at least :data:`MMAP_THRESHOLD`
bytes is mmapped when allocated and unmapped when freed, so one allocated every step (a gradient
after ``zero_grad(set_to_none=True)``) is fresh pages every step, faulted on first write; a smaller
block comes from the heap, which keeps what was freed (trim threshold 1 GiB), so after the first
step it faults no more. Neither depends on the DDP's bucket layout (its buffers live as long as
the buckets), which is why the DDP predictor has no term for it (commlab/costmodel/lowering/ddp.py).
"""

from __future__ import annotations

# 32 MiB: the largest mmap threshold glibc accepts on 64-bit (DEFAULT_MMAP_THRESHOLD_MAX); the
# dynamic threshold never rises above it either, so blocks this large are mmapped in any case.
MMAP_THRESHOLD = 32 << 20
TRIM_THRESHOLD = 1 << 30


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
        return bool(libc.mallopt(m_mmap_threshold, MMAP_THRESHOLD) and libc.mallopt(m_trim_threshold, TRIM_THRESHOLD))
    except (OSError, AttributeError):  # not glibc
        return False
