"""The handle of an asynchronous collective: ``wait()`` bounded by the group's timeout, and its future."""

from __future__ import annotations

import threading
from typing import Any

import torch


class CollectiveHandle:
    """What ``async_op=True`` returns, like torch's ``Work``: ``wait()`` and ``get_future()``.

    The future's value is the reduced tensor (so a DDP comm hook can return it as is).
    ``launched`` is the stamp of the moment the collective started on its channel (a
    ``perf_counter`` float, a CUDA event on the comm stream for CUDA tensors), None until then.
    """

    def __init__(self, future: torch.futures.Future, timeout: float | None = None, what: str = "collective"):
        self._future = future
        self._timeout = timeout
        self._what = what
        self.launched: Any = None

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for completion; raises the collective's error, or TimeoutError after ``timeout``
        (default: twice the group's timeout, a backstop: the backend raises at its timeout first,
        this bounds a job queued behind a collective that hangs outside the backend)."""
        if timeout is None and self._timeout is not None:
            timeout = 2 * self._timeout
        wait_future(self._future, timeout, self._what)
        return True

    def is_completed(self) -> bool:
        return self._future.done()

    def get_future(self) -> torch.futures.Future:
        return self._future


def wait_future(future: torch.futures.Future, timeout: float | None, what: str = "collective") -> Any:
    """``future.wait()`` bounded by ``timeout`` seconds (None: unbounded); TimeoutError names ``what``."""
    if timeout is not None and not future.done():
        finished = threading.Event()
        future.add_done_callback(lambda _: finished.set())
        if not finished.wait(timeout):
            raise TimeoutError(f"{what} did not complete within {timeout:g} s (the process group's timeout)")
    return future.wait()  # re-raises the collective's exception, if any
