"""Activation memory: bytes of tensors autograd saves for backward, counted with saved-tensor hooks.

``torch.autograd.graph.saved_tensors_hooks`` sees every tensor a forward stores for its backward,
so the count is exact on any device (on CPU it is the only measure of activation memory there is).
Parameters are left out: they are alive anyway and are not activation memory. A tensor saved by
two operations (a ReLU's output feeding a Linear) is counted once.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


class SavedBytes:
    """Context manager: ``with SavedBytes(params) as saved: out = f(x)`` then ``saved.nbytes``."""

    def __init__(self, exclude: Iterable[torch.Tensor] = ()):
        self._exclude = {t.data_ptr() for t in exclude}
        self._seen: set[tuple[int, tuple[int, ...], tuple[int, ...]]] = set()
        self.nbytes = 0
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        key = (t.data_ptr(), tuple(t.shape), tuple(t.stride()))
        if t.data_ptr() not in self._exclude and key not in self._seen:
            self._seen.add(key)
            self.nbytes += t.numel() * t.element_size()
        return t  # no copy: the tensor is saved exactly as without the hook

    def __enter__(self) -> SavedBytes:
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)


def _unpack(t: torch.Tensor) -> torch.Tensor:
    return t
