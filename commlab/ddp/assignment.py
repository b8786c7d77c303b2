"""Bucket assignment: which parameters share a bucket, under which size limits.

Pure functions, no processes. They reproduce torch's C++
``compute_bucket_assignment_by_size`` (torch/csrc/distributed/c10d/reducer.cpp, exposed as
``torch.distributed._compute_bucket_assignment_by_size``) and the limit policy of
``_BucketCapacityConfig.compute_bucket_size_limits`` in torch/nn/parallel/distributed.py:

- a bucket holds tensors of one (dtype, device) only, and a tensor is never split;
- tensors are taken in the given order and added to the open bucket of their kind; the bucket
  closes as soon as its size reaches the current limit, and each kind then moves on to the next
  limit in the list (the last one repeats) - this is how the first bucket can be smaller;
- a tensor expecting a sparse gradient gets a bucket of its own;
- with no explicit ``tensor_indices`` the buckets are sorted by their smallest index; with them
  (the rebuild from gradient-ready order) the order of closing is kept.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass

import torch

MIB = 1024 * 1024
DEFAULT_BUCKET_CAP_MB = 25  # torch.nn.parallel.distributed._DEFAULT_BUCKET_CAP_MB
DEFAULT_FIRST_BUCKET_BYTES = MIB  # torch.distributed._DEFAULT_FIRST_BUCKET_BYTES
NO_LIMIT = sys.maxsize


@dataclass(frozen=True)
class TensorSpec:
    """What assignment needs to know about one tensor: its size in bytes and its kind."""

    nbytes: int
    dtype: torch.dtype
    device: torch.device

    @classmethod
    def of(cls, t: torch.Tensor) -> TensorSpec:
        return cls(t.numel() * t.element_size(), t.dtype, t.device)


def compute_bucket_assignment_by_size(
    tensors: Sequence[torch.Tensor | TensorSpec],
    size_limits: Sequence[int],
    expect_sparse_gradient: Sequence[bool] = (),
    tensor_indices: Sequence[int] = (),
) -> tuple[list[list[int]], list[int]]:
    """Group tensors into buckets; return (bucket index lists, each bucket's size limit).

    Equal to ``torch.distributed._compute_bucket_assignment_by_size`` for the same arguments.
    ``tensor_indices[i]``, when given, is the parameter index of ``tensors[i]``.
    """
    if not size_limits:
        raise ValueError("size_limits must hold at least one limit")
    if tensor_indices and len(tensor_indices) != len(tensors):
        raise ValueError("tensor_indices must have one entry per tensor")
    specs = [t if isinstance(t, TensorSpec) else TensorSpec.of(t) for t in tensors]
    result: list[tuple[list[int], int]] = []
    # Per kind: [indices, size, limit position]; dict order = first appearance, which is what
    # the remaining-bucket flush below iterates (torch iterates a hash map: see the docstring
    # of buckets_from_ready_order for the one place this could matter).
    open_buckets: dict[tuple[torch.dtype, torch.device], list] = {}
    for i, spec in enumerate(specs):
        index = tensor_indices[i] if tensor_indices else i
        if expect_sparse_gradient and expect_sparse_gradient[index]:
            result.append(([index], 0))  # torch records kNoSizeLimit (0) for these
            continue
        bucket = open_buckets.setdefault((spec.dtype, spec.device), [[], 0, 0])
        bucket[0].append(index)
        bucket[1] += spec.nbytes
        limit = size_limits[bucket[2]]
        if bucket[1] >= limit:
            result.append((bucket[0], limit))
            bucket[0], bucket[1] = [], 0
            bucket[2] = min(bucket[2] + 1, len(size_limits) - 1)
    for indices, _, position in open_buckets.values():
        if indices:
            result.append((indices, size_limits[position]))
    if not tensor_indices:
        # Buckets ordered by their smallest index, i.e. in parameter (forward-use) order.
        result.sort(key=lambda entry: entry[0][0])
    return [indices for indices, _ in result], [limit for _, limit in result]


def bucket_caps(bucket_cap_mb: float | None, first_bucket_mb: float | None) -> tuple[int, int]:
    """(first bucket cap, bucket cap) in bytes, as torch's _BucketCapacityConfig.create.

    ``bucket_cap_mb=None`` means torch's 25 MiB, and then the first bucket gets torch's 1 MiB;
    an explicit ``bucket_cap_mb`` makes the first bucket as large as the others (torch applies
    the small first bucket only to the default), unless ``first_bucket_mb`` says otherwise.
    """
    check_caps(bucket_cap_mb, first_bucket_mb)
    cap = int((DEFAULT_BUCKET_CAP_MB if bucket_cap_mb is None else bucket_cap_mb) * MIB)
    if first_bucket_mb is not None:
        first = int(first_bucket_mb * MIB)
    else:
        first = DEFAULT_FIRST_BUCKET_BYTES if bucket_cap_mb is None else cap
    return first, cap


def check_caps(bucket_cap_mb: float | None, first_bucket_mb: float | None) -> None:
    """ValueError unless each cap given (in MiB) is positive."""
    for name, value in (("bucket_cap_mb", bucket_cap_mb), ("first_bucket_mb", first_bucket_mb)):
        if value is not None and not value > 0:
            raise ValueError(f"{name} must be positive, got {value}")


def initial_size_limits(first_cap: int, cap: int, find_unused_parameters: bool, static_graph: bool) -> list[int]:
    """Limits for the assignment made at construction (compute_bucket_size_limits in torch).

    Without find_unused_parameters (or with static_graph) torch puts everything in one bucket for
    the first iteration, because parameter order need not be the order gradients arrive in; the
    buckets are rebuilt from the observed order afterwards. With find_unused_parameters there is
    no rebuild, so the small first bucket is used from the start.
    """
    if static_graph or not find_unused_parameters:
        return [NO_LIMIT]
    return [first_cap, cap] if first_cap < cap else [cap]


def will_rebuild(find_unused_parameters: bool, static_graph: bool) -> bool:
    """Reducer::should_rebuild_buckets: buckets are rebuilt once unless unused params are searched."""
    return static_graph or not find_unused_parameters


def initial_buckets(
    params: Sequence[torch.Tensor | TensorSpec], size_limits: Sequence[int], expect_sparse: Sequence[bool] = ()
) -> list[list[int]]:
    """Construction-time buckets in reduction order: torch reverses the parameter-order buckets,
    since gradients of the last-defined parameters tend to be ready first."""
    indices, _ = compute_bucket_assignment_by_size(params, size_limits, expect_sparse)
    return list(reversed(indices))


def buckets_from_ready_order(
    params: Sequence[torch.Tensor | TensorSpec], ready_order: Sequence[int], first_cap: int, cap: int
) -> list[list[int]]:
    """Rebuilt buckets (Reducer::rebuild_buckets): parameters in the order their gradients became
    ready, limits [first bucket cap, cap]; the result is already in reduction order.

    With several (dtype, device) kinds the buckets left open at the end come out in torch's
    hash-map order, which this function does not reproduce (it uses first appearance).
    """
    if sorted(ready_order) != list(range(len(params))):
        raise ValueError("ready_order must be a permutation of the parameter indices")
    indices, _ = compute_bucket_assignment_by_size(
        [params[i] for i in ready_order], [first_cap, cap], (), list(ready_order)
    )
    return indices
