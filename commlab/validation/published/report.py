"""Published rows against predictions: the printed table, the per-table summary, the CSV, the figure.

``commlab validate published`` (commlab/cli/validate.py) runs :func:`collect` over the tables of
:data:`commlab.validation.published.SOURCES` and hands the rows to the three writers here. A row
is a dict with keys table, case, metric, published, predicted, error (predicted / published - 1)
and source; every table's module produces them (its ``rows()``). A row whose case ends in
:data:`FITTED` is the one a constant was derived from: printed, never counted in the summary.
"""

from __future__ import annotations

import csv
import io
import statistics
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

from commlab._atomic import write_text

COLUMNS = ("table", "case", "metric", "published", "predicted", "error", "source")
FITTED = "(fitted)"


def collect(sources: Mapping[str, Callable[[], list[dict]]], names: Iterable[str] = ()) -> list[dict]:
    """The rows of the named tables (all, if none named); ValueError naming the tables there are."""
    chosen = list(names) or list(sources)
    unknown = [n for n in chosen if n not in sources]
    if unknown:
        raise ValueError(f"unknown table(s) {', '.join(unknown)}: the tables are {', '.join(sources)}")
    out = []
    for name in chosen:
        for row in sources[name]():
            missing = [c for c in COLUMNS if c not in row]
            if missing:
                raise ValueError(f"table {name}: a row lacks {', '.join(missing)}")
            out.append(row)
    return out


def summary(rows: list[dict]) -> dict[str, dict[str, float]]:
    """Per table: the median and the worst absolute error, and the rows counted (fitted ones left out)."""
    by: dict[str, list[float]] = {}
    for r in rows:
        if not r["case"].endswith(FITTED):
            by.setdefault(r["table"], []).append(abs(r["error"]))
    return {t: {"median": statistics.median(e), "worst": max(e), "rows": len(e)} for t, e in by.items()}


def lines(rows: list[dict]) -> list[str]:
    """The printed table: one line per row, then one per table's summary."""
    out = [f"{'table':12s} {'case':24s} {'metric':22s} {'published':>10s} {'predicted':>10s} {'error':>8s}"]
    for r in rows:
        out.append(f"{r['table']:12s} {r['case']:24s} {r['metric']:22s} {r['published']:10.4g} {r['predicted']:10.4g} "
                   f"{r['error']:+8.1%}")
    for table, s in summary(rows).items():
        out.append(f"{table}: median |error| {s['median']:.1%}, worst {s['worst']:.1%} over {s['rows']} rows "
                   f"(rows marked {FITTED} not counted)")
    return out


def write_csv(rows: list[dict], path: Path) -> Path:
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=COLUMNS, extrasaction="ignore", lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    write_text(path, buffer.getvalue())
    return Path(path)


def draw(rows: list[dict], path: Path) -> list[Path]:
    """Predicted against published, log-log, the y = x line, one marker per table (PNG and PDF)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import seaborn as sns

    from commlab.sweep.figures import save  # atomic, and PDFs without a creation date

    sns.set_theme(style="whitegrid", context="paper")
    fig, ax = plt.subplots(figsize=(4.6, 4.2))
    markers = "osD^vP*X"
    for i, (table, s) in enumerate(summary(rows).items()):
        mine = [r for r in rows if r["table"] == table]
        ax.scatter([r["published"] for r in mine], [r["predicted"] for r in mine], s=22, marker=markers[i % len(markers)],
                   label=f"{table} (median {s['median']:.1%}, worst {s['worst']:.1%})")
    values = [v for r in rows for v in (r["published"], r["predicted"])]
    low, high = min(values) / 1.5, max(values) * 1.5
    ax.plot([low, high], [low, high], color="grey", lw=1, label="y = x")
    ax.set(xscale="log", yscale="log", xlim=(low, high), ylim=(low, high), xlabel="published",
           ylabel="predicted (commlab)", title="Predicted against published (each row's own unit)")
    ax.legend(fontsize=6)
    fig.tight_layout()
    out = [Path(path).with_suffix(suffix) for suffix in (".png", ".pdf")]
    for p in out:
        save(fig, p)
    plt.close(fig)
    return out
