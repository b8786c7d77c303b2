"""Bucket policies: which gradients share a bucket, one class per policy, registered by name.

A policy answers the two questions torch's Reducer asks (torch/csrc/distributed/c10d/reducer.cpp):

- ``initial(params, rebuild_follows)``: the buckets made at construction, before any gradient was
  seen (``rebuild_follows``: whether the reducer will call ``rebuild`` after the first iteration);
- ``rebuild(params, ready_order)``: the buckets made once from the order in which gradients
  became ready in the first iteration (rank 0's order).

Both take the parameters as :class:`~commlab.ddp.assignment.TensorSpec` (bytes, dtype, device,
in module order) and return lists of parameter indices in reduction order, each index exactly
once. commlab's DistributedDataParallel (``bucket_policy=``), the predictor (``DDPSetting.policy``),
the tuner and the sweep (``bucket_policy`` in a spec) all take a registered name or an instance::

    @register
    class OnePerParameter(BucketPolicy):
        name = "one_per_parameter"
        def initial(self, params, rebuild_follows): return [[i] for i in reversed(range(len(params)))]
        def rebuild(self, params, ready_order): return [[i] for i in ready_order]

A name of the form ``package.module:Class`` imports that class (spawned sweep ranks find it so).
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from typing import ClassVar

from commlab.ddp.assignment import (
    NO_LIMIT,
    TensorSpec,
    bucket_caps,
    check_caps,
    buckets_from_ready_order,
    initial_buckets,
)

DEFAULT_POLICY = "size_cap"


class BucketPolicy:
    """Base of every policy: the caps of DDP's ``bucket_cap_mb`` and ``first_bucket_mb`` (in bytes,
    torch's rules: :func:`~commlab.ddp.assignment.bucket_caps`), which a policy may ignore. The
    policy is where a DDP's caps are held: its ``bucket_bytes_cap`` reads ``cap`` here."""

    name: ClassVar[str] = ""

    def __init__(self, bucket_cap_mb: float | None = None, first_bucket_mb: float | None = None):
        self.bucket_cap_mb, self.first_bucket_mb = bucket_cap_mb, first_bucket_mb
        self.first_cap, self.cap = bucket_caps(bucket_cap_mb, first_bucket_mb)

    def initial(self, params: Sequence[TensorSpec], rebuild_follows: bool) -> list[list[int]]:
        raise NotImplementedError

    def rebuild(self, params: Sequence[TensorSpec], ready_order: Sequence[int]) -> list[list[int]]:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}(bucket_cap_mb={self.bucket_cap_mb}, first_bucket_mb={self.first_bucket_mb})"


_REGISTRY: dict[str, type[BucketPolicy]] = {}


def register(cls: type[BucketPolicy]) -> type[BucketPolicy]:
    """Add a policy class under its ``name`` (usable as a decorator); a name is taken once."""
    if not (isinstance(cls, type) and issubclass(cls, BucketPolicy)) or not cls.name:
        raise ValueError(f"a bucket policy is a BucketPolicy subclass with a name, got {cls!r}")
    if _REGISTRY.get(cls.name, cls) is not cls:
        raise ValueError(f"bucket policy {cls.name!r} is already registered ({_REGISTRY[cls.name].__qualname__})")
    _REGISTRY[cls.name] = cls
    return cls


def policy_names() -> list[str]:
    return sorted(_REGISTRY)


def make_policy(policy: str | BucketPolicy = DEFAULT_POLICY, *, bucket_cap_mb: float | None = None,
                first_bucket_mb: float | None = None) -> BucketPolicy:
    """The policy an option names (built with the caps), or ``policy`` itself if it is one (its
    own caps hold then; the ones given are still checked)."""
    if isinstance(policy, BucketPolicy):
        check_caps(bucket_cap_mb, first_bucket_mb)
        return policy
    if not isinstance(policy, str):
        raise TypeError(f"bucket_policy must be a name or a BucketPolicy, got {type(policy).__name__}")
    if policy in _REGISTRY:
        return _REGISTRY[policy](bucket_cap_mb, first_bucket_mb)
    module, sep, attr = policy.partition(":")
    if sep:
        try:
            cls = getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as err:
            raise ValueError(f"bucket policy {policy!r}: {err}") from None
        if isinstance(cls, type) and issubclass(cls, BucketPolicy):
            return cls(bucket_cap_mb, first_bucket_mb)
        raise ValueError(f"bucket policy {policy!r} is not a BucketPolicy subclass")
    raise ValueError(f"unknown bucket policy {policy!r}: choose from {', '.join(policy_names())} "
                     "or give package.module:Class")


def checked(buckets: Sequence[Sequence[int]], count: int, policy: BucketPolicy) -> list[list[int]]:
    """``buckets`` as lists, after checking that they hold every parameter index exactly once."""
    out = [list(b) for b in buckets]
    if sorted(i for b in out for i in b) != list(range(count)) or any(not b for b in out):
        raise ValueError(f"bucket policy {policy!r} must put each of the {count} parameters in exactly one "
                         f"non-empty bucket, got {out}")
    return out


@register
class SizeCapPolicy(BucketPolicy):
    """torch's policy (the default): buckets closed at a byte cap, a smaller first bucket.

    At construction, when a rebuild follows, torch puts every parameter in one bucket (the
    unlimited first iteration of torch 2.13's ``_BucketCapacityConfig``): parameter order need
    not be the order gradients arrive in. Otherwise, and at the rebuild, limits are
    [first bucket cap, cap] (1 MiB then 25 MiB by default; an explicit ``bucket_cap_mb`` makes the
    first bucket as large as the others).
    """

    name = DEFAULT_POLICY

    def initial(self, params: Sequence[TensorSpec], rebuild_follows: bool) -> list[list[int]]:
        if rebuild_follows:
            limits = [NO_LIMIT]
        else:
            limits = [self.first_cap, self.cap] if self.first_cap < self.cap else [self.cap]
        return initial_buckets(params, limits)

    def rebuild(self, params: Sequence[TensorSpec], ready_order: Sequence[int]) -> list[list[int]]:
        return buckets_from_ready_order(params, ready_order, self.first_cap, self.cap)
