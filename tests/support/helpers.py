"""Small helpers shared by test modules (importable in spawned ranks: the repository root is on their path)."""

from __future__ import annotations

from collections.abc import Callable


def error_of(call: Callable[[], object]) -> str:
    """``"Type: message"`` of what ``call()`` raises, or ``"no error"`` (the test reads the message)."""
    try:
        call()
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {e}"
    return "no error"
