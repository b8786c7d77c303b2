"""Pipeline Gantt charts say their time unit (simulated costs or ms) and which shade is which."""

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402

from commlab.pipeline import simulate  # noqa: E402
from commlab.pipeline.schedule.render import SIMULATED_UNIT, gantt, gantt_figure  # noqa: E402
from commlab.pipeline.schedule.registry import one_f_one_b  # noqa: E402


def test_gantt_axes_have_units_and_a_legend(tmp_path, monkeypatch):
    timeline = simulate(one_f_one_b(2, 4), 1.0, 2.0).timeline
    fig, ax = plt.subplots()
    gantt(ax, timeline, 2, "sim")
    assert ax.get_xlabel() == f"time ({SIMULATED_UNIT})"
    gantt(ax, timeline, 2, "measured", unit="ms")
    assert ax.get_xlabel() == "time (ms)"
    plt.close(fig)

    seen = {}
    monkeypatch.setattr(plt.Figure, "tight_layout", lambda self, *a, **k: seen.setdefault("fig", self))
    gantt_figure([("a", timeline), ("b", timeline)], 2, str(tmp_path / "g.png"), unit="ms")
    axes = seen["fig"].axes
    labels = [t.get_text() for t in axes[0].get_legend().get_texts()]
    assert labels == ["forward (light)", "backward (dark)"]
    assert axes[0].get_shared_x_axes().joined(axes[0], axes[1])
    assert (tmp_path / "g.png").stat().st_size > 1000
