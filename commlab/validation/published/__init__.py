"""Published results the cost model is checked against, never read by the model."""

from __future__ import annotations

from collections.abc import Callable

from commlab.validation.published import korthikanti, megatron

# Each table's rows: dicts with keys table, case, metric, published, predicted, error
# (predicted / published - 1) and source (report.py prints them).
SOURCES: dict[str, Callable[[], list[dict]]] = {"megatron": megatron.rows, "korthikanti": korthikanti.rows}
