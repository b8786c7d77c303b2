"""A console progress bar over a sweep's configurations, with elapsed time and ETA."""

from __future__ import annotations

import time
from collections.abc import Callable


def bar(done: int, total: int, elapsed: float, width: int = 24) -> str:
    """``[#########...............] 3/8  elapsed 0:42  ETA 1:10`` (ETA from the mean so far)."""
    filled = width if total == 0 else round(width * done / total)
    eta = "--:--" if done == 0 else clock(elapsed / done * (total - done))
    return f"[{'#' * filled}{'.' * (width - filled)}] {done}/{total}  elapsed {clock(elapsed)}  ETA {eta}"


def clock(seconds: float) -> str:
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    if hours:
        return f"{hours}:{rest // 60:02d}:{rest % 60:02d}"
    return f"{rest // 60}:{rest % 60:02d}"


class Progress:
    """Counts finished configurations and prints a summary line plus the bar after each."""

    def __init__(self, total: int, echo: Callable[[str], None]):
        self.total, self.done, self.echo = total, 0, echo
        self.start = time.monotonic()
        echo(bar(0, total, 0.0))

    def advance(self, summary: str) -> None:
        self.done += 1
        self.echo(summary)
        self.echo(bar(self.done, self.total, time.monotonic() - self.start))
