"""Activation memory: what autograd saves for backward, and a per-rank ledger of every live tensor.

``torch.autograd.graph.saved_tensors_hooks`` sees every tensor a forward stores for its backward,
so :class:`SavedBytes` is exact on any device (on CPU it is the only measure of activation memory
there is). Parameters are left out: they are alive anyway and are not activation memory.

:class:`Ledger` is the executor's per-rank account. A holder (a stashed micro-batch, a posted
receive buffer, a send in flight, a hand-over between two stages on the same rank) holds tensors;
a storage held by several holders (the output a stage keeps for its backward and also sends) is
counted once, and only while some holder has it. ``peak`` is the largest total seen in a step,
with what each kind of holder held at that moment.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


def _key(t: torch.Tensor) -> tuple[int, int]:
    storage = t.untyped_storage()
    return storage.data_ptr(), storage.nbytes()


class SavedBytes:
    """Context manager: ``with SavedBytes(params) as saved: out = f(x)`` then ``saved.nbytes``.

    ``saved.tensors`` lists the saved storages (a tensor saved by two operations is one entry).
    """

    def __init__(self, exclude: Iterable[torch.Tensor] = ()):
        # a DTensor (a ZeRO layer's parameter shard) has no storage of its own: its local piece's
        self._exclude = {(t.to_local() if hasattr(t, "to_local") else t).untyped_storage().data_ptr() for t in exclude}
        self.tensors: dict[int, int] = {}  # storage pointer -> bytes
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)

    @property
    def nbytes(self) -> int:
        return sum(self.tensors.values())

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        ptr, nbytes = _key(t)
        if ptr not in self._exclude and ptr:
            self.tensors[ptr] = nbytes
        return t  # no copy: the tensor is saved exactly as without the hook

    def __enter__(self) -> SavedBytes:
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)


def _unpack(t: torch.Tensor) -> torch.Tensor:
    return t


class Ledger:
    """Bytes held per rank, by kind of holder; see the module docstring."""

    def __init__(self) -> None:
        self._holders: dict[tuple, tuple[str, dict[int, int]]] = {}
        self._count: dict[int, int] = {}
        self._size: dict[int, int] = {}
        self.current = 0
        self.peak = 0
        self.peak_by_kind: dict[str, int] = {}

    def hold(self, kind: str, name: tuple, tensors: Iterable[torch.Tensor | None] = (), storages: dict[int, int] | None = None) -> None:
        """``name`` (of kind ``kind``: stash, recv, send, local) now holds these tensors / storages."""
        held = dict(storages or {})
        for t in tensors:
            if t is not None:
                ptr, nbytes = _key(t)
                held[ptr] = nbytes
        self.drop((kind, *name))
        self._holders[(kind, *name)] = (kind, held)
        for ptr, nbytes in held.items():
            self._count[ptr] = self._count.get(ptr, 0) + 1
            if self._count[ptr] == 1:
                self._size[ptr] = nbytes
                self.current += nbytes
        if self.current > self.peak:
            self.peak = self.current
            self.peak_by_kind = self.by_kind()

    def drop(self, key: tuple) -> None:
        found = self._holders.pop(key, None)
        if found is None:
            return
        for ptr in found[1]:
            self._count[ptr] -= 1
            if not self._count[ptr]:
                del self._count[ptr]
                self.current -= self._size.pop(ptr)

    def held_bytes(self, kind: str, name: tuple) -> int:
        """Bytes holder ``name`` of ``kind`` holds now, shared storages counted in full (KeyError if none)."""
        return sum(self._holders[(kind, *name)][1].values())

    def by_kind(self) -> dict[str, int]:
        """Bytes per kind of holder now (a storage shared by two kinds counts in both)."""
        out: dict[str, int] = {}
        for kind, held in self._holders.values():
            out[kind] = out.get(kind, 0) + sum(held.values())
        return out


class NoCount:
    """Stands in for :class:`SavedBytes` when memory is not tracked: counts nothing."""

    tensors: dict = {}

    def __enter__(self) -> NoCount:
        return self

    def __exit__(self, *exc) -> None:
        return None
