"""Bucketed, overlapped data parallelism: commlab's DistributedDataParallel and its timings.

Names load on first use (PEP 562), so that the run vocabulary reads the timing columns
(commlab/ddp/timing.py) without importing torch.
"""

from __future__ import annotations

from commlab._lazy import lazy_getattr

__getattr__ = lazy_getattr("commlab.ddp", {
    "DistributedDataParallel": "commlab.ddp.distributed",
    "BucketTiming": "commlab.ddp.timing",
    "IterationTiming": "commlab.ddp.timing",
})

__all__ = ["BucketTiming", "DistributedDataParallel", "IterationTiming"]
