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

    def fill(self, slot: int, divide_by: int | None, as_view: bool) -> None:
        """Copy parameter ``slot``'s gradient into the buffer, divided by ``divide_by`` on the way
        (torch pre-divides unless a comm hook owns the bucket: ``None``)."""
        p, view = self.params[slot], self.views[slot]
        grad = p.grad
        if grad is None:  # locally unused: contributes zeros (torch's mark_variable_ready_dense)
            view.zero_()
        elif grad.data_ptr() == view.data_ptr():  # already a view into the bucket
            if divide_by is not None:
                view.div_(divide_by)
        else:
            if divide_by is not None:
                torch.mul(grad, 1.0 / divide_by, out=view)  # divide while copying: one pass
            else:
                view.copy_(grad)
            if as_view:
                p.grad = view

    def write_back(self, globally_unused: list[bool] | None, as_view: bool) -> None:
        """Reduced values into ``.grad``; ``globally_unused`` (by parameter index) are skipped."""
        if globally_unused is None and not as_view and all(p.grad is not None for p in self.params):
            torch._foreach_copy_([p.grad for p in self.params], self.views)  # one op per bucket
            return
        for i, p, view in zip(self.param_indices, self.params, self.views):
            if globally_unused is not None and globally_unused[i]:
                continue  # as torch: a parameter no rank used keeps its .grad untouched
            if as_view:
                if p.grad is None or p.grad.data_ptr() != view.data_ptr():
                    p.grad = view
            elif p.grad is None:
                p.grad = view.clone()
            else:
                p.grad.copy_(view)


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
