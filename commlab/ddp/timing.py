"""Per-iteration timings that DDP records: forward, backward compute, each bucket, exposed comm.

All times are seconds relative to the start of the iteration's forward (``t0``). On CPU they come
from ``time.perf_counter``; on CUDA from events, resolved after the iteration.

Definitions (the DDP paper's latency breakdown, Li et al. VLDB 2020, section 5):
- ``forward``: forward start -> forward end;
- ``backward_compute``: forward end -> the last gradient becomes ready;
- ``comm``: the first bucket launched -> the last bucket done (wall span of communication);
- ``exposed_comm``: the last gradient ready -> all buckets done and written back, i.e. the part of
  communication that backward did not hide;
- ``total``: forward start -> gradients synchronised (end of backward).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class BucketTiming:
    index: int  # position in reduction order
    nbytes: int
    num_params: int
    ready: float  # its last gradient arrived
    launched: float  # its all-reduce was started
    done: float  # its all-reduce completed


@dataclass
class IterationTiming:
    forward: float
    backward_compute: float
    comm: float
    exposed_comm: float
    total: float
    buckets: list[BucketTiming] = field(default_factory=list)

    def as_row(self) -> dict[str, float]:
        """The scalar columns, for a tidy table (per-bucket rows come from ``buckets``)."""
        row = asdict(self)
        row.pop("buckets")
        return row
