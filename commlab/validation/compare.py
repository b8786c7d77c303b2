"""Predicted against measured: per-configuration error, shape error, rank order, one figure.

Pure pandas over two ``runs`` tables (commlab/runs/store.py) plus the drawing:

- error = predicted / measured - 1 of the median step time;
- shape error: the same after dividing out one common factor per workload (model, sizes,
  backend, world size, batch), the median of measured / predicted over its configurations. It is
  what is left when the machine's drift (20-30% over minutes here) is taken out, and it
  is what picking a bucket needs;
- Kendall's tau between the predicted and the measured order of bucket sizes in each series (the
  configurations that differ only in bucket size); a series counts as *resolved* when its
  measured times spread by at least three times their noise (half the p10-p90 width).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from commlab.runs.config import CONFIG_COLUMNS, DEFAULTS

# Columns that identify a configuration across runs with different step counts.
MATCH = [c for c in CONFIG_COLUMNS if c not in ("config", "iters", "warmup")]
DEFAULT_POLICY = DEFAULTS["bucket_policy"]
WORKLOAD = ["model", "model_args", "backend", "world_size", "batch_per_rank"]


def kendall_tau(a, b) -> float:
    """Kendall's tau-b of two equally long sequences: ties (two bucket caps that give the same
    buckets) count for neither order. NaN for fewer than two items or a constant sequence."""
    a, b = np.asarray(a, float), np.asarray(b, float)
    s = pairs_a = pairs_b = 0.0
    for i in range(len(a)):
        da, db = np.sign(a[i] - a[i + 1:]), np.sign(b[i] - b[i + 1:])
        s += float(np.sum(da * db))
        pairs_a += float(np.count_nonzero(da))
        pairs_b += float(np.count_nonzero(db))
    return s / np.sqrt(pairs_a * pairs_b) if pairs_a and pairs_b else float("nan")


def join(predicted: pd.DataFrame, measured: pd.DataFrame) -> pd.DataFrame:
    """One row per configuration present (and successful) in both runs tables."""
    # Runs recorded before the bucket policy was a configuration column used the default one.
    predicted, measured = (f.assign(bucket_policy=f["bucket_policy"].fillna(DEFAULT_POLICY)) if "bucket_policy" in f else f
                           for f in (predicted, measured))
    keys = [c for c in MATCH if c in predicted and c in measured]
    m = measured[measured["status"] == "ok"][keys + ["config", "step_median", "step_p10", "step_p90"]]
    p = predicted[predicted["status"] == "ok"][keys + ["config", "step_median"]]
    both = p.merge(m, on=keys, suffixes=("_predicted", "_measured"))
    both = both.rename(columns={"step_median_predicted": "predicted_s", "step_median_measured": "measured_s",
                                "config_predicted": "config"}).drop(columns=["config_measured"])
    both["error"] = both["predicted_s"] / both["measured_s"] - 1.0
    factor = both.groupby(WORKLOAD, dropna=False)[["measured_s", "predicted_s"]].transform("median")
    both["workload_factor"] = factor["measured_s"] / factor["predicted_s"]
    both["shape_error"] = both["predicted_s"] * both["workload_factor"] / both["measured_s"] - 1.0
    both["noise_s"] = (both["step_p90"] - both["step_p10"]) / 2.0
    return both


def series_taus(both: pd.DataFrame) -> pd.DataFrame:
    """Kendall's tau over bucket sizes per series, and whether the series is resolved."""
    keys = [c for c in MATCH if c in both and c != "bucket_mb"]
    rows = []
    for values, s in both.groupby(keys, dropna=False):
        if len(s) < 2:
            continue
        spread = s["measured_s"].max() - s["measured_s"].min()
        rows.append({**dict(zip(keys, values)), "points": len(s),
                     "tau": kendall_tau(s["measured_s"], s["predicted_s"]),
                     "resolved": bool(spread >= 3 * s["noise_s"].median())})
    return pd.DataFrame(rows)


def summary(both: pd.DataFrame, taus: pd.DataFrame) -> dict[str, float]:
    abs_err, shape = both["error"].abs(), both["shape_error"].abs()
    resolved = taus[taus["resolved"]] if not taus.empty else taus
    return {"configs": len(both), "median_abs_error": float(abs_err.median()), "worst_abs_error": float(abs_err.max()),
            "median_shape_error": float(shape.median()), "worst_shape_error": float(shape.max()),
            "series": len(taus), "resolved_series": len(resolved),
            "min_tau_resolved": float(resolved["tau"].min()) if len(resolved) else float("nan"),
            "mean_tau": float(taus["tau"].mean()) if len(taus) else float("nan")}


def report(both: pd.DataFrame, taus: pd.DataFrame) -> str:
    lines = [f"{'configuration':<58s} {'measured':>9s} {'predicted':>9s} {'error':>7s} {'shape':>7s}"]
    for r in both.itertuples(index=False):
        lines.append(f"{r.config:<58s} {r.measured_s * 1e3:7.1f}ms {r.predicted_s * 1e3:7.1f}ms "
                     f"{r.error * 100:+6.1f}% {r.shape_error * 100:+6.1f}%")
    s = summary(both, taus)
    lines.append(f"abs error: median {s['median_abs_error'] * 100:.1f}%, worst {s['worst_abs_error'] * 100:.1f}%; "
                 f"shape error: median {s['median_shape_error'] * 100:.1f}%, worst {s['worst_shape_error'] * 100:.1f}% "
                 f"({s['configs']} configurations)")
    for r in taus.to_dict("records"):
        what = ", ".join(f"{k}={r[k]}" for k in ("model", "world_size", "algorithm", "overlap", "groups") if k in r)
        lines.append(f"Kendall tau over bucket sizes [{what}]: {r['tau']:+.2f} ({r['points']} sizes"
                     f"{', resolved' if r['resolved'] else ', within noise'})")
    return "\n".join(lines)


SERIES = ("model", "model_args", "world_size", "algorithm", "bucket_policy", "overlap", "groups", "accumulate")
_WORDS = {"world_size": "world {}", "overlap": "overlap {}", "groups": "{} groups", "accumulate": "accumulate {}",
          "bucket_policy": "{} buckets"}


def series_label(values: dict, varying) -> str:
    """A legend entry for one bucket-size series: the settings that differ between series, in
    words ("mlp, world 4, overlap off"); "all configurations" when only the bucket size varies."""
    parts = []
    for key in varying:
        value = values[key]
        if key == "overlap":
            value = "on" if value in (True, "True", "true") else "off"
        if key == "model_args" and not value:
            value = "default sizes"
        parts.append(_WORDS.get(key, "{}").format(value))
    return ", ".join(parts) or "all configurations"


def draw(both: pd.DataFrame, path: Path) -> list[Path]:
    """Scatter of predicted vs measured against y = x, and measured bucket-size curves with the
    predicted ones over them (dashed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.8))
    ms, ps = both["measured_s"] * 1e3, both["predicted_s"] * 1e3
    a.scatter(ms, ps, s=14)
    hi = float(max(ms.max(), ps.max())) * 1.05
    a.plot([0, hi], [0, hi], color="grey", lw=1, label="y = x")
    a.set(xlabel="measured step (ms)", ylabel="predicted step (ms)", xlim=(0, hi), ylim=(0, hi))
    a.legend(fontsize=7)
    keys = [c for c in SERIES if c in both]
    varying = [c for c in keys if both[c].nunique(dropna=False) > 1]
    for i, (values, s) in enumerate(both.sort_values("bucket_mb").groupby(keys, dropna=False)):
        color = f"C{i % 10}"
        name = series_label(dict(zip(keys, values)), varying)
        b.plot(s["bucket_mb"], s["measured_s"] * 1e3, "o-", color=color, lw=1, ms=3, label=name)
        b.plot(s["bucket_mb"], s["predicted_s"] * 1e3, "x--", color=color, lw=1, ms=3)
    b.set(xscale="log", xlabel="bucket cap (MiB)", ylabel="step (ms)", title="measured (solid), predicted (dashed)")
    b.legend(fontsize=5)
    fig.tight_layout()
    from commlab.sweep.figures import save  # atomic, and PDFs without a creation date

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    out = [path.with_suffix(suffix) for suffix in (".png", ".pdf")]
    for p in out:
        save(fig, p)
    plt.close(fig)
    return out


def workload_table(both: pd.DataFrame, taus: pd.DataFrame, agree: float = 0.10) -> pd.DataFrame:
    """The validation table, one row per workload and one for all of them together.

    Medians over every configuration; worst cases over those whose two measurements (forward and
    reverse) agree within ``agree`` (``agreement`` column; all when absent); Kendall's tau over
    the resolved series only (measured spread >= 3x noise).
    """
    def row(name: str, b: pd.DataFrame, t: pd.DataFrame) -> dict:
        steady = b[b["agreement"] <= agree] if "agreement" in b else b
        resolved = t[t["resolved"]] if len(t) else t
        taus_ = resolved["tau"].dropna() if len(resolved) else pd.Series(dtype=float)
        return {"workload": name, "configs": len(b), "steady": len(steady),
                "shape_median": float(b["shape_error"].abs().median()),
                "shape_worst": float(steady["shape_error"].abs().max()) if len(steady) else float("nan"),
                "abs_median": float(b["error"].abs().median()),
                "abs_worst": float(steady["error"].abs().max()) if len(steady) else float("nan"),
                "resolved_series": f"{len(taus_)}/{len(t)}",
                "tau_min": float(taus_.min()) if len(taus_) else float("nan")}

    keys = [k for k in WORKLOAD if k in both]
    rows = []
    for values, b in both.groupby(keys, dropna=False):
        sel = np.ones(len(taus), bool)
        for k, v in zip(keys, values):
            if k in taus:
                sel &= (taus[k] == v).to_numpy()
        name = f"{values[0]} {values[1]} w{values[3]}".replace("examples.heldout_models:", "")
        rows.append(row(name, b, taus[sel] if len(taus) else taus))
    rows.append(row("all", both, taus))
    return pd.DataFrame(rows)


def format_table(table: pd.DataFrame) -> str:
    """The table as fixed-width text (percentages)."""
    lines = [f"{'workload':<44s} {'n':>3s} {'shape med':>9s} {'worst':>6s} {'abs med':>8s} {'worst':>6s} "
             f"{'tau min (resolved)':>18s}"]
    pct = lambda x: "  n/a" if x != x else f"{x * 100:4.1f}%"  # noqa: E731
    for r in table.itertuples(index=False):
        tau = "n/a" if r.tau_min != r.tau_min else f"{r.tau_min:+.2f}"
        lines.append(f"{r.workload[:44]:<44s} {r.configs:3d} {pct(r.shape_median):>9s} {pct(r.shape_worst):>6s} "
                     f"{pct(r.abs_median):>8s} {pct(r.abs_worst):>6s} {tau + ' (' + r.resolved_series + ')':>18s}")
    return "\n".join(lines)
