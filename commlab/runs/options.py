"""Sweep option values: comma-separated lists, numbers, on/off words and model arguments, parsed.

Pure functions; each raises ``ValueError`` naming the option (``--bucket-mb: ...``), which the CLI
turns into a usage error before any process starts.
"""

from __future__ import annotations

from typing import Any

from commlab.runs.optimizers import parse_optimizer
from commlab.runs.zero_stage import parse_stage


def parse_list(value: Any, item, option: str) -> list:
    """``"5,25,100"``, ``[5, 25]`` or ``5`` -> a list of parsed, de-duplicated items, order kept."""
    if value is None:
        raise ValueError(f"--{_dash(option)} needs a value")
    raw = value if isinstance(value, (list, tuple)) else str(value).split(",")
    out: list = []
    for piece in raw:
        text = str(piece).strip()
        if not text:
            raise ValueError(f"--{_dash(option)}: empty item in {value!r}")
        parsed = item(text, option)
        if parsed not in out:
            out.append(parsed)
    if not out:
        raise ValueError(f"--{_dash(option)} needs at least one value")
    return out


def positive_float(text: str, option: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"--{_dash(option)}: {text!r} is not a number") from None
    if not value > 0 or value != value or value == float("inf"):
        raise ValueError(f"--{_dash(option)}: {text!r} must be a positive number")
    return value


def positive_int(text: str, option: str) -> int:
    return _int_at_least(text, option, 1, "a positive integer")


def _int_at_least(text: str, option: str, low: int, what: str) -> int:
    try:
        value = int(str(text))
    except ValueError:
        raise ValueError(f"--{_dash(option)}: {text!r} is not an integer") from None
    if value < low:
        raise ValueError(f"--{_dash(option)}: {text!r} must be {what}")
    return value


def overlap_values(value: Any, option: str = "overlap") -> list[bool]:
    """``on``/``off``/``both`` (or a YAML bool, or a list of them) -> a boolean axis (--overlap, --reshard)."""
    words = {"on": [True], "true": [True], "off": [False], "false": [False], "both": [True, False]}
    items = value if isinstance(value, (list, tuple)) else [value]
    out: list[bool] = []
    for item in items:
        key = str(item).strip().lower()
        if key not in words:
            raise ValueError(f"--{_dash(option)}: {item!r} is not one of on, off, both")
        out += [v for v in words[key] if v not in out]
    return out


def parse_model_args(value: Any) -> dict[str, Any]:
    """``"depth=2,width=64"`` or a YAML mapping -> ``{"depth": 2, "width": 64}``."""
    if isinstance(value, dict):
        pairs = [(str(k), v) for k, v in value.items()]
    else:
        pairs = []
        for piece in filter(None, (p.strip() for p in str(value or "").split(","))):
            key, sep, text = piece.partition("=")
            if not sep or not key.strip():
                raise ValueError(f"--model-args: {piece!r} is not key=value")
            pairs.append((key.strip(), _scalar(text.strip())))
    return dict(sorted(pairs))


def canonical_model_args(value: Any) -> str:
    return ",".join(f"{k}={v}" for k, v in parse_model_args(value).items())


def stage_value(text: str, option: str) -> int:
    """A ZeRO stage (commlab/runs/zero_stage.py): 0 (commlab DDP) to 3."""
    try:
        return parse_stage(text).stage
    except ValueError as err:
        raise ValueError(f"--{_dash(option)}: {err}") from None


def optimizer_value(text: str, option: str) -> str:
    """A registered optimizer (commlab/runs/optimizers.py): sgd, momentum, adam, adamw."""
    try:
        return parse_optimizer(text)
    except ValueError as err:
        raise ValueError(f"--{_dash(option)}: {err}") from None


def non_negative_int(text: str, option: str) -> int:
    return _int_at_least(text, option, 0, "a non-negative integer")


def _scalar(text: str) -> Any:
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def _dash(option: str) -> str:
    return option.replace("_", "-")
