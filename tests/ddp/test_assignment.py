"""Bucket assignment and size-limit policy against torch's own functions, without processes."""

import random

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel.distributed import _BucketCapacityConfig

import commlab
from commlab.ddp.assignment import (
    NO_LIMIT,
    TensorSpec,
    bucket_caps,
    buckets_from_ready_order,
    compute_bucket_assignment_by_size,
    initial_buckets,
    initial_size_limits,
    will_rebuild,
)
from commlab.ddp.policy import SizeCapPolicy
from commlab.models import TinyTransformer, mlp


def _bn_model():
    return nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 30 * 30, 10))


def _mixed_dtype_model():
    m = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64), nn.Linear(64, 32), nn.Linear(32, 8))
    m[1].double()
    m[3].half()
    return m


MODELS = {
    "mlp": lambda: mlp(6, 128),
    "transformer": lambda: TinyTransformer(vocab=128, d_model=32, layers=2, heads=2, seq=16),
    "batchnorm": _bn_model,
    "mixed_dtypes": _mixed_dtype_model,
}
LIMITS = [[1], [NO_LIMIT], [1024 * 1024], [4096, 65536], [25 * 1024 * 1024], [300, 5000, 20000]]


@pytest.mark.parametrize("model", sorted(MODELS))
def test_assignment_equals_torch_for_models_and_limits(model):
    params = [p for p in MODELS[model]().parameters() if p.requires_grad]
    for limits in LIMITS:
        ours = compute_bucket_assignment_by_size(params, limits)
        theirs = dist._compute_bucket_assignment_by_size(params, limits)
        assert ours == (theirs[0], list(theirs[1])), (model, limits)
        # Specs alone (no tensors) give the same answer: assignment needs only sizes and kinds.
        assert compute_bucket_assignment_by_size([TensorSpec.of(p) for p in params], limits) == ours
        # The rebuild path: parameters in an arbitrary "ready" order with their indices.
        order = list(range(len(params)))
        random.Random(len(params) + len(limits)).shuffle(order)
        ours = compute_bucket_assignment_by_size([params[i] for i in order], limits, (), order)
        theirs = dist._compute_bucket_assignment_by_size([params[i] for i in order], limits, [], order)
        if len({(p.dtype, p.device) for p in params}) == 1:
            assert ours == (theirs[0], list(theirs[1])), (model, limits, "ready order")
        else:  # buckets left open at the end come in torch's hash-map order (documented)
            assert sorted(ours[0]) == sorted(theirs[0]), (model, limits, "ready order")


def test_assignment_equals_torch_randomised_with_sparse_flags():
    rng = random.Random(7)
    dtypes = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
    for trial in range(200):
        n = rng.randint(1, 40)
        tensors = [torch.empty(rng.randint(1, 6000), dtype=rng.choice(dtypes)) for _ in range(n)]
        limits = rng.choice(LIMITS)
        sparse = [rng.random() < 0.15 for _ in range(n)] if trial % 3 == 0 else []
        ours = compute_bucket_assignment_by_size(tensors, limits, sparse)
        theirs = dist._compute_bucket_assignment_by_size(tensors, limits, sparse)
        assert ours == (theirs[0], list(theirs[1])), trial
        flat = sorted(i for bucket in ours[0] for i in bucket)
        assert flat == list(range(n))  # every tensor in exactly one bucket, never split


def test_a_bucket_closes_at_its_limit_and_the_first_limit_applies_once():
    f32 = [TensorSpec(400, torch.float32, torch.device("cpu"))] * 5
    # 400 >= 300 closes the first bucket at once; later buckets use 1000 (closing at 1200).
    assert compute_bucket_assignment_by_size(f32, [300, 1000])[0] == [[0], [1, 2, 3], [4]]
    assert compute_bucket_assignment_by_size(f32, [1])[0] == [[0], [1], [2], [3], [4]]
    assert compute_bucket_assignment_by_size(f32, [NO_LIMIT])[0] == [[0, 1, 2, 3, 4]]


@pytest.mark.parametrize("cap_mb", [None, 1, 25, 0.001, 100.5])
@pytest.mark.parametrize("find_unused", [False, True])
@pytest.mark.parametrize("static", [False, True])
def test_size_limit_policy_equals_torch(cap_mb, find_unused, static):
    config = _BucketCapacityConfig.create(cap_mb, None, use_python_reducer=False)
    first, cap = bucket_caps(cap_mb, None)
    assert (first, cap) == (config.first_bucket_bytes_cap, config.bucket_bytes_cap)
    torch_limits = config.compute_bucket_size_limits(static, find_unused)[0]
    assert initial_size_limits(first, cap, find_unused, static) == torch_limits
    assert will_rebuild(find_unused, static) == (static or not find_unused)
    # The default bucket policy's construction-time buckets are torch's limits applied.
    specs = [TensorSpec(n, torch.float32, torch.device("cpu")) for n in (300_000, 700_000, 1_500_000, 40_000)]
    policy = SizeCapPolicy(cap_mb, None)
    assert policy.initial(specs, will_rebuild(find_unused, static)) == initial_buckets(specs, torch_limits)


def test_first_bucket_override_and_reduction_order():
    assert bucket_caps(None, 0.5) == (512 * 1024, 25 * 1024 * 1024)
    assert bucket_caps(10, 2) == (2 * 1024 * 1024, 10 * 1024 * 1024)
    params = list(mlp(4, 256).parameters())  # 256x256 floats = 256 KiB per weight
    in_order = compute_bucket_assignment_by_size(params, [300 * 1024])[0]
    assert initial_buckets(params, [300 * 1024]) == in_order[::-1]  # reduction order: last layers first
    ready = list(range(len(params)))[::-1]
    # First cap 1 byte: the classifier's bias alone; then buckets close once they reach 300 KiB.
    assert buckets_from_ready_order(params, ready, 1, 300 * 1024) == [[9], [8, 7, 6, 5, 4], [3, 2, 1, 0]]


def test_bad_input_is_a_value_error():
    with pytest.raises(ValueError, match="bucket_cap_mb"):
        bucket_caps(0, None)
    with pytest.raises(ValueError, match="first_bucket_mb"):
        bucket_caps(25, -1)
    with pytest.raises(ValueError, match="size_limits"):
        compute_bucket_assignment_by_size([torch.zeros(2)], [])
    with pytest.raises(ValueError, match="permutation"):
        buckets_from_ready_order([torch.zeros(2)] * 3, [0, 0, 1], 1, 10)


def test_constructor_rejects_bad_arguments_before_touching_process_groups():
    model = mlp(2, 8)
    with pytest.raises(ValueError, match="unknown all-reduce algorithm 'carrier-pigeon'"):
        commlab.DistributedDataParallel(model, algorithm="carrier-pigeon")
    with pytest.raises(ValueError, match="bucket_cap_mb must be positive"):
        commlab.DistributedDataParallel(model, bucket_cap_mb=-5)
    with pytest.raises(ValueError, match="nn.Module"):
        commlab.DistributedDataParallel(lambda x: x)
    with pytest.raises(RuntimeError, match="initialised process group"):
        commlab.DistributedDataParallel(model)
