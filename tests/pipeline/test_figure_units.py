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


def test_bench_figures_label_microbatches_as_integers_and_peaks_in_words(tmp_path, monkeypatch):
    import pandas as pd

    from commlab.bench import pipeline_figures as figures

    summary = pd.DataFrame({"schedule": ["gpipe"] * 3, "microbatches": [2, 4, 8], "checkpoint": "never", "balance_mode": "time",
                            "commlab_samples_per_s": [10.0, 12.0, 13.0], "torch_samples_per_s": [9.0, 11.0, 12.0]})  # fmt: skip
    stages = pd.DataFrame({"config": ["a", "a"], "schedule": "gpipe", "microbatches": 8, "checkpoint": "never",
                           "balance_mode": "time", "rank": [0, 1], "rank_peak_bytes": [2**20, 2**21]})  # fmt: skip
    drawn = []
    monkeypatch.setattr(plt, "close", lambda fig: drawn.append(fig))
    figures._throughput(summary, tmp_path / "t.png")
    figures._peaks(stages, tmp_path / "p.png")
    ticks = [t.get_text() for t in drawn[0].axes[0].get_xticklabels()]
    assert ticks == ["2", "4", "8"]
    assert drawn[1].axes[0].get_ylabel() == "measured peak MiB held" and "ledger" not in drawn[1].axes[0].get_ylabel()


def test_simulated_messages_come_from_the_comm_pass_and_are_drawn():
    sim = simulate(one_f_one_b(2, 2), 1.0, 2.0, 0.5)
    # Every SEND of the lowered lists, each taking the 0.5 of --comm, sender to receiver.
    assert [(str(m), m.src, m.dst, end - start) for m, start, end in sim.messages] == [
        ("0F0>1F0", 0, 1, 0.5), ("0F1>1F1", 0, 1, 0.5), ("1B0>0B0", 1, 0, 0.5), ("1B1>0B1", 1, 0, 0.5)]
    fig, ax = plt.subplots()
    gantt(ax, sim.timeline, 2, "sim", messages=sim.messages)
    assert len(ax.get_lines()) == 4  # one line per message
    plt.close(fig)
