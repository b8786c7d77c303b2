"""Pictures of a schedule: the step x rank text grid and a Gantt figure of a (simulated or measured) timeline.

The grid is the schedule's own clock (:func:`commlab.pipeline.schedule.clock.clock`) with a tick per
forward, so row t shows what each rank does at tick t (torchgpipe's clock-cycle view); "." is a bubble.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from commlab.pipeline.schedule.actions import FORWARD, Actions, flatten
from commlab.pipeline.schedule.clock import clock
from commlab.pipeline.schedule.comm import Message
from commlab.pipeline.schedule.simulate import Timed

# What a simulated time is measured in: the --forward/--backward/--comm costs it was given.
SIMULATED_UNIT = "units of the --forward/--backward costs"


def grid(actions: Actions, backward: int | None = None) -> str:
    """The step x rank table of a schedule, as printed by ``commlab pipeline show``.

    A forward takes one tick, a backward ``backward`` ticks (a split one: I and W half each;
    default 1, or 2 when the schedule splits, so I and W take a tick each); an action taking
    several ticks is written in each. The parts of an overlapped pair (``O``) get their own ticks,
    each marked ``~``.
    """
    paired = {p for rank in actions for a in rank if a.parts for p in a.parts}
    actions = flatten(actions)
    if backward is None:
        backward = 2 if any(a.kind in "IW" for rank in actions for a in rank) else 1
    if any(a.kind in "IW" for rank in actions for a in rank) and backward % 2:
        raise ValueError(f"a split backward needs an even number of ticks, got {backward}")
    span = clock(actions, {"F": 1, "B": backward, "I": backward // 2, "W": backward // 2})
    ranks = len(actions)
    cells = [["."] * ranks for _ in range(max((end for _, end in span.values()), default=0))]
    for r, rank in enumerate(actions):
        for a in rank:
            for tick in range(*span[a]):
                cells[tick][r] = str(a) + ("~" if a in paired else "")
    width = max(5, *(len(str(a)) + 1 for a in span))
    header = "step " + " ".join(f"{f'rank{r}':>{width}}" for r in range(ranks))
    rows = [f"{k:>4} " + " ".join(f"{c:>{width}}" for c in row) for k, row in enumerate(cells)]
    return "\n".join([header, *rows])


def gantt(ax, timeline: Sequence[Timed], ranks: int, title: str = "", unit: str = SIMULATED_UNIT,
          messages: Sequence[tuple[Message, float, float]] = ()) -> None:  # fmt: skip
    """Draw one bar per action on a matplotlib axis: rank on y, time on x, forward light, backward dark.

    Micro-batch numbers are written in the bars; the same function draws simulated and measured
    timelines so the two can be compared panel by panel. ``messages`` (a simulation's SEND ops:
    message, start, end) are drawn as thin lines from the sender's row to the receiver's.
    """
    for m, start, end in messages:
        ax.plot([start, end], [m.src, m.dst], color="0.4", linewidth=0.6, zorder=3)
    import seaborn as sns

    palette = sns.color_palette("Paired")
    for t in timeline:
        color = palette[(2 * t.action.stage) % len(palette)] if t.action.kind == FORWARD else palette[(2 * t.action.stage + 1) % len(palette)]
        ax.barh(t.rank, t.end - t.start, left=t.start, height=0.8, color=color, edgecolor="white", linewidth=0.5)
        if t.end - t.start > 0:
            ax.text((t.start + t.end) / 2, t.rank, str(t.action.microbatch), ha="center", va="center", fontsize=6)
    ax.set_yticks(range(ranks), [f"rank {r}" for r in range(ranks)])
    ax.invert_yaxis()
    ax.set_xlabel(f"time ({unit})")
    if title:
        ax.set_title(title, fontsize=9)


def gantt_figure(panels: Sequence[tuple], ranks: int, path: str, unit: str = SIMULATED_UNIT) -> None:
    """Save stacked Gantt panels (e.g. simulated over measured) to ``path`` with the Agg backend.

    A panel is (title, timeline) or (title, timeline, messages). All panels share the time axis
    (they are compared); one legend says which shade is forward and which backward. ``unit`` names
    the time axis's unit.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import seaborn as sns
    from matplotlib.patches import Patch

    from commlab._atomic import write_via

    fig, axes = plt.subplots(len(panels), 1, figsize=(9, 1.0 + 0.5 * ranks * len(panels)), squeeze=False, sharex=True)
    for ax, (title, timeline, *messages) in zip(axes[:, 0], panels):
        gantt(ax, timeline, ranks, title, unit, *messages)
        ax.xaxis.set_tick_params(labelbottom=True)
    palette = sns.color_palette("Paired")
    legend = [Patch(color=palette[0], label="forward (light)"), Patch(color=palette[1], label="backward (dark)")]
    axes[0, 0].legend(handles=legend, loc="lower left", bbox_to_anchor=(1.0, 0.0), fontsize=7,
                      title="colour = stage", title_fontsize=7)
    fig.tight_layout()
    write_via(path, lambda tmp: fig.savefig(tmp, format=Path(path).suffix[1:] or "png", dpi=120))
    plt.close(fig)
