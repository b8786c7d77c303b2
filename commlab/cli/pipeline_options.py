"""The pipeline commands' shared option parsing: comma-separated integers and schedule names."""

from __future__ import annotations

import click

from commlab.pipeline.schedule.registry import REGISTRY
from commlab.runs.optimizers import OPTIMIZERS as registered_optimizers

SCHEDULE_NAMES = tuple(REGISTRY)  # the registry is the one list of schedules
OPTIMIZERS = ("none", *registered_optimizers)  # the planner's OPTIMIZER_STATE keys (that module imports torch)


def ints(text: str, option: str) -> list[int]:
    try:
        values = [int(v) for v in str(text).split(",") if v.strip()]
    except ValueError:
        raise click.BadParameter(f"expected comma-separated integers, got {text!r}", param_hint=option) from None
    if not values or min(values) < 1:
        raise click.BadParameter(f"expected positive integers, got {text!r}", param_hint=option)
    return values


def names(text: str, allowed: tuple[str, ...], option: str) -> list[str]:
    names = [v.strip() for v in text.split(",") if v.strip()]
    bad = [n for n in names if n not in allowed]
    if bad or not names:
        raise click.BadParameter(f"{', '.join(bad) or text!r}: choose from {', '.join(allowed)}", param_hint=option)
    return names
