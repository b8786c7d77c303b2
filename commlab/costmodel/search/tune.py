"""Tuning without a sweep: search DDP's knobs with the simulator and recommend the fastest.

Two answers, kept apart because they paste into different code:

- **torch**: the best torch ``DistributedDataParallel``, searched over what torch lets a user set
  and priced with torch's own rules: the backend's all-reduce (``native``), overlap always, the
  size-cap buckets, and an explicit ``bucket_cap_mb`` making the *first* bucket as large as the
  others (torch 2.13 ``_BucketCapacityConfig.create`` keeps the 1 MiB first bucket for the
  default only). Its ``ddp_kwargs`` hold torch keywords only ({} is torch's default);
- **commlab**: the best commlab ``DistributedDataParallel`` over every algorithm given (by
  default every registered one), overlap on and off, a first bucket as large as the others or
  1 MiB, and the bucket policies given.

The search is exhaustive over a fine log grid of bucket caps (cheap: one simulated step is a few
hundred tasks). The baseline is torch's default: 25 MiB with a 1 MiB first bucket, ``native``,
overlap. :func:`answer` adds the intervals and the refusal of commlab/costmodel/terms/uncertainty.py.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from commlab.costmodel.terms import uncertainty
from commlab.costmodel.lowering.ddp import DEFAULT_POLICY, DDPSetting, StepCosts, breakdown, simulate_step

DEFAULT_GRID_MB = tuple(round(0.5 * 2 ** (i / 4), 3) for i in range(0, 35))  # 0.5 .. ~181 MB, 19% steps
TORCH_ALGORITHM = "native"  # torch's DDP calls the process group's own all-reduce


@dataclass(frozen=True)
class Candidate:
    """One configuration and its predicted step time."""

    algorithm: str
    setting: DDPSetting
    step_s: float

    def ddp_kwargs(self) -> dict[str, Any]:
        """torch keywords only: {} for torch's default."""
        mb = self.setting.bucket_cap_mb
        return {} if mb is None else {"bucket_cap_mb": mb}

    def commlab_kwargs(self) -> dict[str, Any]:
        s = self.setting
        return {"algorithm": self.algorithm, "overlap": s.overlap, "first_bucket_mb": s.first_bucket_mb,
                "bucket_policy": _policy_name(s.policy)}


@dataclass(frozen=True)
class Recommendation:
    torch: Candidate
    commlab: Candidate
    default: Candidate


def step_time(costs: StepCosts, setting: DDPSetting) -> float:
    result, buckets = simulate_step(costs, setting)
    return breakdown(result, buckets, costs)[0]["step"]


def torch_settings(grid_mb: Sequence[float] = DEFAULT_GRID_MB) -> list[DDPSetting]:
    """What torch's DDP can be told: its default, or an explicit cap (first bucket = cap)."""
    return [DDPSetting(), *(DDPSetting(bucket_cap_mb=mb) for mb in grid_mb)]


def commlab_settings(grid_mb: Sequence[float] = DEFAULT_GRID_MB, overlaps: Sequence[bool] = (True, False),
                     first_buckets: Sequence[float | None] = (None, 1.0),
                     policies: Sequence[Any] = (DEFAULT_POLICY,), with_default: bool = True) -> list[DDPSetting]:
    """``first_buckets``: None is a first bucket as large as the others, 1.0 is 1 MiB;
    ``with_default``: torch's default (25 MiB, 1 MiB first) is a candidate too."""
    out = [DDPSetting()] if with_default else []
    for policy, overlap, mb, first in itertools.product(policies, overlaps, grid_mb, first_buckets):
        if first is None or first < mb:
            out.append(DDPSetting(bucket_cap_mb=mb, first_bucket_mb=first, overlap=overlap, policy=policy))
    return out


def fastest(costs: Mapping[str, StepCosts], candidates: Iterable[tuple[str, DDPSetting]]) -> Candidate:
    """The fastest candidate; near-ties (1e-9 relative) go to the larger bucket (fewer launches),
    then to the earlier candidate, so the answer depends on nothing but the costs."""
    best: Candidate | None = None
    for algorithm, setting in candidates:
        t = step_time(costs[algorithm], setting)
        if best is None or t < best.step_s * (1 - 1e-9) or (
                t <= best.step_s * (1 + 1e-9) and _cap(setting) > _cap(best.setting)):
            best = Candidate(algorithm, setting, t)
    if best is None:
        raise ValueError("nothing to search")
    return best


def search(costs: Mapping[str, StepCosts], grid_mb: Sequence[float] = DEFAULT_GRID_MB,
           overlaps: Sequence[bool] = (True, False), first_buckets: Sequence[float | None] = (None, 1.0),
           policies: Sequence[Any] = (DEFAULT_POLICY,), with_default: bool = True) -> Recommendation:
    """The best torch configuration and the best commlab configuration for ``costs`` (one
    StepCosts per algorithm); torch's needs the ``native`` algorithm's costs."""
    if not costs:
        raise ValueError("tune needs the costs of at least one algorithm")
    if TORCH_ALGORITHM not in costs:
        raise ValueError(f"tune needs the {TORCH_ALGORITHM!r} all-reduce's costs (torch's DDP uses it); "
                         f"got {', '.join(sorted(costs))}")
    default = Candidate(TORCH_ALGORITHM, DDPSetting(), step_time(costs[TORCH_ALGORITHM], DDPSetting()))
    torch_best = fastest(costs, ((TORCH_ALGORITHM, s) for s in torch_settings(grid_mb)))
    settings = commlab_settings(grid_mb, overlaps, first_buckets, policies, with_default)
    # native first: on a tie the backend's own all-reduce (what torch uses) is kept
    algorithms = sorted(costs, key=lambda a: (a != TORCH_ALGORITHM, a))
    commlab_best = fastest(costs, ((a, s) for a in algorithms for s in settings))
    return Recommendation(torch_best, commlab_best, default)


def answer(rec: Recommendation, steadiness: uncertainty.Steadiness | None, *, force: bool = False) -> dict[str, Any]:
    """The JSON answer: both picks with intervals, the default's time, and ``steady``.

    An unsteady calibration recommends torch's default in both answers (with the widened
    interval) unless ``force``: a pick from numbers the machine's load bent is worse than none.
    """
    width = uncertainty.half_width(steadiness)
    refuse = steadiness is not None and not steadiness.steady and not force
    torch_pick, commlab_pick = (rec.default, rec.default) if refuse else (rec.torch, rec.commlab)

    def priced(c: Candidate) -> dict[str, Any]:
        return {"predicted_step_s": c.step_s, "interval_s": uncertainty.interval(c.step_s, width)}

    return {"torch": {"ddp_kwargs": torch_pick.ddp_kwargs(), **priced(torch_pick)},
            "commlab": {"ddp_kwargs": commlab_pick.ddp_kwargs(), "commlab_kwargs": commlab_pick.commlab_kwargs(),
                        **priced(commlab_pick)},
            "default_step_s": rec.default.step_s,
            "steady": steadiness is None or steadiness.steady}


def _cap(setting: DDPSetting) -> float:
    return 25.0 if setting.bucket_cap_mb is None else setting.bucket_cap_mb


def _policy_name(policy: Any) -> str:
    return policy if isinstance(policy, str) else type(policy).name
