"""Published results the cost model is checked against, never read by the model."""

from __future__ import annotations

from collections.abc import Callable

from commlab.validation.published import collectives, ddp_paper, korthikanti, megatron

# Each table's rows: dicts with keys table, case, metric, published, predicted, error
# (predicted / published - 1) and source (report.py prints them).
SOURCES: dict[str, Callable[[], list[dict]]] = {
    "collectives": collectives.rows, "ddp-benchmark": ddp_paper.rows,
    "megatron": megatron.rows, "korthikanti": korthikanti.rows}
