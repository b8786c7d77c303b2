"""The one costs type (what a machine costs) beside workload profiles (what a workload computes).

:class:`SystemCosts` holds everything calibration measured (or a hardware preset states) about
the machine, in one place; what a workload computes is a small profile of its own
(:class:`DDPProfile`, :class:`StageProfile`). A lowering takes one of each
(commlab/costmodel/lowering/ddp.py's ``step_costs`` for DDP). Pure dataclasses and functions over
numbers that calibration measured (commlab/costmodel/calibration/driver.py) or that a hardware preset
states (commlab/costmodel/hardware/presets.py); nothing here touches torch.

- A collective's time over the sizes that occur is the measured table, interpolated linearly in
  size between neighbouring points (and extrapolated from the last two points above the table):
  on this machine one alpha-beta line misses small sizes by up to 31% (measured 2026-11), the
  table does not. The alpha-beta fit (:func:`commlab.costmodel.terms.alpha_beta.fit_alpha_beta`) is kept
  beside it, with its residuals, to say how far the straight line is from what was measured.
- Contention: while compute and communication run at once on one host, compute advances at
  1 / (1 + kc) and communication at 1 / (1 + km) (on a CPU they share cores and memory
  bandwidth). :func:`solve_contention` recovers (kc, km) from one run of each alone and one run
  of both started together.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from commlab.costmodel.terms.alpha_beta import fit_alpha_beta


@dataclass(frozen=True)
class CollectiveCost:
    """Time of one all-reduce of ``nbytes`` for one algorithm on one world size."""

    sizes: tuple[int, ...]  # bytes, increasing
    seconds: tuple[float, ...]
    alpha_s: float = math.nan  # the alpha-beta line, kept for reports and presets
    beta_bytes_per_s: float = math.nan

    def __post_init__(self) -> None:
        if len(self.sizes) != len(self.seconds) or len(self.sizes) < 2:
            raise ValueError("a collective cost table needs one time per size and at least two sizes")
        if list(self.sizes) != sorted(set(self.sizes)):
            raise ValueError("collective cost table sizes must be distinct and increasing")

    def __call__(self, nbytes: float) -> float:
        x, y = self.sizes, self.seconds
        if nbytes <= x[0]:
            # Below the table the time cannot fall under the smallest measured one by much:
            # latency dominates there, so hold the first point rather than extrapolate to zero.
            return float(y[0])
        if nbytes >= x[-1]:
            slope = (y[-1] - y[-2]) / (x[-1] - x[-2])
            return float(y[-1] + max(slope, 0.0) * (nbytes - x[-1]))
        return float(np.interp(nbytes, x, y))

    @classmethod
    def line(cls, alpha_s: float, beta_bytes_per_s: float) -> CollectiveCost:
        """A pure alpha-beta cost (hardware presets): a two-point table on the line."""
        sizes = (1, 1 << 40)
        return cls(sizes, tuple(alpha_s + s / beta_bytes_per_s for s in sizes), alpha_s, beta_bytes_per_s)



@dataclass(frozen=True)
class PointToPoint:
    """One message of ``nbytes`` between two ranks: ``alpha_s + nbytes * beta_s_per_byte``."""

    alpha_s: float = 0.0
    beta_s_per_byte: float = 0.0

    def __call__(self, nbytes: float) -> float:
        return self.alpha_s + nbytes * self.beta_s_per_byte


@dataclass(frozen=True)
class Contention:
    """How one algorithm's collectives and compute slow each other on a host (the fluid model).

    ``kc``/``km``: compute runs at 1/(1+kc) beside communication, communication at 1/(1+km)
    beside compute. ``lanes``: collectives one channel runs at once (Gloo's process group has two
    worker threads, ProcessGroupGloo::Options threads=2, so two queued native all-reduces run
    together; commlab's p2p algorithms run one at a time); ``lane_gain``: the aggregate speed of
    two at once over one.
    """

    kc: float = 0.0
    km: float = 0.0
    lanes: int = 1
    lane_gain: float = 1.0
    # Where calibration measured queued collectives (commlab/costmodel/calibration/queueing.py): the time
    # per collective while two run at once, by size; None: ``lane_gain`` at every size.
    paired: CollectiveCost | None = None
    # A memory copy (a bucket's write-back) beside a collective, where measured; None: kc / km.
    kc_copy: float | None = None
    km_copy: float | None = None

    def gain_at(self, nbytes: float, alone_s: float) -> float:
        """The lanes' gain for collectives of ``nbytes`` that take ``alone_s`` one at a time: the
        measured paired time against it where measured (clipped to [0.5, 2]), else ``lane_gain``."""
        if self.paired is None:
            return self.lane_gain
        paired = self.paired(nbytes)
        return min(max(alone_s / paired, 0.5), 2.0) if paired > 0 else self.lane_gain


@dataclass(frozen=True)
class Overheads:
    """Fixed costs of the runtime itself, in seconds."""

    bucket_fixed_s: float = 0.0  # the reducer's launch of one bucket
    writeback_s_per_byte: float = 0.0  # copying a reduced bucket back into .grad
    action_s: float = 0.0  # a pipeline executor's own time per action


@dataclass(frozen=True)
class SystemCosts:
    """What calibration measured about a machine (or a hardware preset states), in one place.

    ``collectives`` is keyed by (collective, algorithm, world size), e.g. ("allreduce", "ring", 4).
    ``corun``: how much a rank's compute stretches when every rank of the host computes at once;
    ``corun_optimizer`` and ``corun_copy``: the same for the optimizer step and the write-back's
    memory copy (memory-bound: they share the host's bandwidth), None where not stated. A
    calibration sets all three to 1: its profile already ran beside every rank's own DDP loop.
    """

    collectives: Mapping[tuple[str, str, int], CollectiveCost] = field(default_factory=dict)
    p2p: PointToPoint = PointToPoint()
    contention: Mapping[str, Contention] = field(default_factory=dict)  # per algorithm
    corun: float = 1.0
    corun_optimizer: float | None = None
    corun_copy: float | None = None
    overheads: Overheads = Overheads()

    def collective(self, collective: str, algorithm: str, world_size: int) -> CollectiveCost:
        """The cost table of one collective; ValueError naming what was calibrated if absent."""
        key = (collective, algorithm, world_size)
        if key not in self.collectives:
            have = ", ".join(f"{c}/{a}/w{w}" for c, a, w in sorted(self.collectives)) or "none"
            raise ValueError(f"no {collective} cost for algorithm {algorithm!r} at world size {world_size} "
                             f"(calibrated: {have})")
        return self.collectives[key]

    def contention_of(self, algorithm: str) -> Contention:
        """An algorithm's contention; none measured means none modelled."""
        return self.contention.get(algorithm, Contention())


@dataclass(frozen=True)
class DDPProfile:
    """What one rank of a DDP workload computes, in seconds (profiled inside DDP on one rank)."""

    forward_s: float
    ready_s: tuple[float, ...]  # per parameter in ready order: ready time after forward's end
    ready_order: tuple[int, ...]  # parameter indices (module order) in the order grads are ready
    param_nbytes: tuple[int, ...]  # module order
    optimizer_s: float
    nosync_s: float  # one no_sync micro-batch (forward + backward)

    def __post_init__(self) -> None:
        if len(self.ready_s) != len(self.ready_order):
            raise ValueError("ready_s and ready_order must have one entry per parameter")

    def scaled(self, speedup: float) -> DDPProfile:
        """The same workload on a device ``speedup`` times as fast."""
        return DDPProfile(self.forward_s / speedup, tuple(t / speedup for t in self.ready_s), self.ready_order,
                          self.param_nbytes, self.optimizer_s / speedup, self.nosync_s / speedup)


@dataclass(frozen=True)
class StageProfile:
    """What each pipeline stage computes per micro-batch, in seconds, and what it sends.

    ``backward[s]`` is B = I + W, W taking ``weight_share`` of it; ``message_bytes[s]``: the
    boundary after stage s (activations forward, the same size of gradients back);
    ``param_nbytes[s]``: stage s's gradients, for its data-parallel buckets.
    """

    forward: tuple[float, ...]
    backward: tuple[float, ...]
    weight_share: float = 0.5
    message_bytes: tuple[float, ...] = ()
    param_nbytes: tuple[tuple[int, ...], ...] = ()
    optimizer_s: float = 0.0


def fit_table(sizes: Sequence[int], seconds: Sequence[float]) -> dict:
    """The table plus its alpha-beta line and the line's relative residual at every size."""
    order = np.argsort(sizes)
    x = [int(sizes[i]) for i in order]
    y = [float(seconds[i]) for i in order]
    alpha_us, beta_gbps, r2 = fit_alpha_beta(x, y)
    alpha, beta = alpha_us * 1e-6, beta_gbps * 1e9
    # A table of differences (fresh memory: allocating anew less rewriting) can hold a 0 under load.
    residuals = [((alpha + s / beta) - t) / t if beta > 0 and t > 0 else math.nan for s, t in zip(x, y)]
    return {"sizes": x, "seconds": y, "alpha_s": alpha, "beta_bytes_per_s": beta, "r2": r2,
            "line_residuals": residuals}


def cost_from_entry(entry: dict) -> CollectiveCost:
    return CollectiveCost(tuple(int(s) for s in entry["sizes"]), tuple(float(t) for t in entry["seconds"]),
                          float(entry.get("alpha_s", math.nan)), float(entry.get("beta_bytes_per_s", math.nan)))


def solve_contention(compute_alone: float, comm_alone: float, compute_both: float, comm_both: float) -> tuple[float, float]:
    """(kc, km) of the fluid model from a compute and a collective run alone and started together.

    Whichever of the two ends first ran slowed down for its whole life, so its own factor is
    its stretch: k = t_both / t_alone - 1. The other ran slowed only until then: it did
    t_first / (1 + k) of its work in t_first and the rest at full speed, so
    t_both = t_first + (t_alone - t_first / (1 + k)), which gives its k. Factors below zero
    (noise: the pair ran faster than either alone) are clipped to zero.
    """
    for name, value in (("compute_alone", compute_alone), ("comm_alone", comm_alone),
                        ("compute_both", compute_both), ("comm_both", comm_both)):
        if not value > 0:
            raise ValueError(f"{name} must be a positive time, got {value}")
    if comm_both <= compute_both:
        km = max(comm_both / comm_alone - 1.0, 0.0)
        kc = _other(compute_alone, compute_both, comm_both)
    else:
        kc = max(compute_both / compute_alone - 1.0, 0.0)
        km = _other(comm_alone, comm_both, compute_both)
    return kc, km


def _other(alone: float, both: float, first_end: float) -> float:
    # Work done while slowed: first_end * r, with r = 1 / (1 + k); the rest, alone - first_end * r,
    # at full speed: both = first_end + alone - first_end * r  =>  r = 1 - (both - alone) / first_end.
    rate = 1.0 - (both - alone) / first_end
    if rate >= 1.0:
        return 0.0
    rate = max(rate, 0.25)  # beyond a 4x slow-down the run was disturbed (other jobs), not contended
    return 1.0 / rate - 1.0
