"""Bucketed, overlapped data parallelism: commlab's DistributedDataParallel and its timings."""

from commlab.ddp.distributed import DistributedDataParallel
from commlab.ddp.timing import BucketTiming, IterationTiming

__all__ = ["BucketTiming", "DistributedDataParallel", "IterationTiming"]
