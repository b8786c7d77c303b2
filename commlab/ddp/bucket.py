"""A gradient bucket: one flat buffer, per-parameter views into it, and its state in an iteration.

``GradBucket`` is what a communication hook receives; it has the methods of torch's
``torch.distributed.GradBucket`` (torch/csrc/distributed/c10d/comm.hpp), so torch's own hooks in
``ddp_comm_hooks.default_hooks`` run on it unchanged.
"""

from __future__ import annotations

import itertools
from typing import Any

import torch


class Bucket:
    """Parameters reduced together: a contiguous buffer and a view of it shaped like each one."""

    def __init__(self, position: int, param_indices: list[int], params: list[torch.Tensor]):
        self.position = position  # index in reduction order
        self.param_indices = param_indices
        self.params = params
        first = params[0]
        self.numels = [p.numel() for p in params]
        self.offsets = [0, *itertools.accumulate(self.numels)][:-1]
        self.buffer = torch.zeros(sum(self.numels), dtype=first.dtype, device=first.device)
        self.views = [
            self.buffer[o : o + n].view(p.shape) for o, n, p in zip(self.offsets, self.numels, params)
        ]
        self.nbytes = self.buffer.numel() * self.buffer.element_size()
        self.pending = len(params)
        self.future: torch.futures.Future | None = None
        self.ready_at: Any = None
        self.launched_at: Any = None
        self.done_at: Any = None

    def reset(self) -> None:
        """Start a new synchronised iteration: no gradient has arrived yet."""
        self.pending = len(self.params)
        self.future = None
        self.ready_at = self.launched_at = self.done_at = None


class GradBucket:
    """The bucket as a communication hook sees it (torch's GradBucket interface)."""

    def __init__(self, bucket: Bucket, is_last: bool):
        self._bucket = bucket
        self._buffer = bucket.buffer
        self._is_last = is_last

    def index(self) -> int:
        return self._bucket.position

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def set_buffer(self, buffer: torch.Tensor) -> None:
        # As in torch, this replaces what the hook sees; the reducer takes the hook's future result.
        self._buffer = buffer

    def gradients(self) -> list[torch.Tensor]:
        b = self._bucket
        return [self._buffer[o : o + n].view(p.shape) for o, n, p in zip(b.offsets, b.numels, b.params)]

    def parameters(self) -> list[torch.Tensor]:
        return list(self._bucket.params)

    def is_last(self) -> bool:
        return self._is_last
