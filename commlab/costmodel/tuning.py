"""Tuning without a sweep: search DDP's knobs with the simulator and recommend the fastest.

The search is exhaustive over a fine grid (it is cheap: one simulated step is a few hundred
tasks): bucket_cap_mb on a log grid, the first bucket as large as the others or torch's 1 MiB,
every calibrated algorithm, overlap on and off. The baseline is torch's default: 25 MiB with a
1 MiB first bucket, the backend's own all-reduce, overlap.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from commlab.costmodel.lower import DEFAULT_POLICY, DDPSetting, StepCosts, breakdown, simulate_step

DEFAULT_GRID_MB = tuple(round(0.5 * 2 ** (i / 4), 3) for i in range(0, 35))  # 0.5 .. ~181 MB, 19% steps


@dataclass(frozen=True)
class Recommendation:
    algorithm: str
    setting: DDPSetting
    predicted_step_s: float
    default_step_s: float

    def as_json(self) -> dict:
        """``ddp_kwargs`` holds only torch DDP keywords (paste into torch code); the rest is commlab's."""
        return {"ddp_kwargs": {"bucket_cap_mb": self.setting.bucket_cap_mb},
                "commlab_kwargs": {"algorithm": self.algorithm, "overlap": self.setting.overlap,
                                   "first_bucket_mb": self.setting.first_bucket_mb,
                                   "bucket_policy": _policy_name(self.setting.policy)},
                "predicted_step_s": self.predicted_step_s, "default_step_s": self.default_step_s,
                "gain": self.default_step_s / self.predicted_step_s - 1.0}


def step_time(costs: StepCosts, setting: DDPSetting) -> float:
    result, buckets = simulate_step(costs, setting)
    return breakdown(result, buckets, costs)[0]["step"]


def search(costs: Mapping[str, StepCosts], grid_mb: Sequence[float] = DEFAULT_GRID_MB,
           overlaps: Sequence[bool] = (True, False), default_algorithm: str = "native",
           first_buckets: Sequence[float | None] = (None, 1.0),
           policies: Sequence[Any] = (DEFAULT_POLICY,)) -> Recommendation:
    """The fastest (algorithm, setting) over the grid; ties go to the larger bucket (fewer launches).

    ``first_buckets``: None is a first bucket as large as the others (what an explicit
    bucket_cap_mb gives in torch, and what `commlab sweep` measures), 1.0 is torch's 1 MiB.
    ``policies``: the bucket policies searched (names or instances, commlab/ddp/policy.py); the
    baseline is torch's default, whatever they are.
    """
    if not costs:
        raise ValueError("tune needs the costs of at least one algorithm")
    if default_algorithm not in costs:
        default_algorithm = sorted(costs)[0]
    default = step_time(costs[default_algorithm], DDPSetting())
    best: tuple[float, float, str, DDPSetting] | None = None
    for algorithm, c in sorted(costs.items()):
        for policy, overlap in itertools.product(policies, overlaps):
            for mb in grid_mb:
                for first in first_buckets:
                    if first is not None and first >= mb:
                        continue
                    setting = DDPSetting(bucket_cap_mb=mb, first_bucket_mb=first, overlap=overlap, policy=policy)
                    t = step_time(c, setting)
                    key = (t, -mb, algorithm, setting)
                    if best is None or t < best[0] * (1 - 1e-9) or (math.isclose(t, best[0], rel_tol=1e-9) and mb > -best[1]):
                        best = key
    assert best is not None
    t, _, algorithm, setting = best
    return Recommendation(algorithm, setting, t, default)


def _policy_name(policy: Any) -> str:
    return policy if isinstance(policy, str) else type(policy).name
