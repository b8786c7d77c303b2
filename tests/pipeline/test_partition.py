"""Splitting an nn.Sequential and balancing it: the minimax partition against brute force."""

import itertools
import random

import pytest
import torch
from torch import nn

from commlab.pipeline import balance_by_size, balance_by_time, partition, split
from commlab.pipeline.runtime.memory import SavedBytes
from commlab.pipeline.runtime.partition import profile_sizes


def _brute_force(costs, parts):
    """The smallest possible slowest stage over every way to cut the layers."""
    n = len(costs)
    best = float("inf")
    for cuts in itertools.combinations(range(1, n), parts - 1):
        bounds = (0, *cuts, n)
        best = min(best, max(sum(costs[a:b]) for a, b in zip(bounds, bounds[1:])))
    return best


def _slowest(costs, balance):
    out, start = [], 0
    for count in balance:
        out.append(sum(costs[start : start + count]))
        start += count
    return max(out)


def test_partition_is_optimal_against_brute_force():
    rng = random.Random(0)
    for _ in range(200):
        n = rng.randint(1, 9)
        parts = rng.randint(1, n)
        costs = [rng.choice([0.0, 1.0, rng.random() * 10]) for _ in range(n)]
        balance = partition(costs, parts)
        assert len(balance) == parts and sum(balance) == n and min(balance) >= 1
        assert _slowest(costs, balance) == pytest.approx(_brute_force(costs, parts))


def test_partition_literal_cases_and_errors():
    assert partition([1, 1, 1, 1], 2) == [2, 2]
    assert partition([1, 1, 1, 1, 1], 2) == [2, 3]  # a tie: the later stage takes the extra layer
    assert partition([5, 1, 1, 1, 1, 1], 2) == [1, 5]
    assert partition([1, 2, 3, 4, 5, 6, 7, 8, 9], 3) == [5, 2, 2]  # 15 | 13 | 17
    with pytest.raises(ValueError, match="cannot split 3 layers into 4"):
        partition([1, 1, 1], 4)
    with pytest.raises(ValueError, match="non-negative"):
        partition([1, -1], 1)


def test_split_shares_layers_and_checks_the_balance():
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    stages = split(model, [2, 3])
    assert [len(s) for s in stages] == [2, 3]
    assert stages[1][0] is model[2]  # no copy: gradients land on the model's own parameters
    x = torch.randn(3, 4)
    torch.testing.assert_close(stages[1](stages[0](x)), model(x))
    with pytest.raises(ValueError, match="sums to 4, but the model has 5 layers"):
        split(model, [2, 2])
    with pytest.raises(ValueError, match="positive"):
        split(model, [5, 0])
    with pytest.raises(ValueError, match="nn.Sequential"):
        split(nn.Linear(2, 2), [1])


def test_sizes_count_parameters_and_saved_activations_exactly():
    n = 8
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4))
    sizes = profile_sizes(model, torch.randn(n, 16))
    # Linear saves its input (the weight is a parameter, counted once as such); ReLU its output.
    assert sizes == [4 * (16 * 64 + 64) + 4 * n * 16, 4 * n * 64, 4 * (64 * 4 + 4) + 4 * n * 64]
    assert balance_by_size(model, torch.randn(n, 16), 2) == partition(sizes, 2)
    with SavedBytes(model.parameters()) as saved:
        model(torch.randn(n, 16)).sum()
    assert saved.nbytes == 4 * n * (16 + 64)  # the ReLU output and the last Linear's input are one tensor


def test_balance_by_time_returns_a_valid_split():
    model = nn.Sequential(*[nn.Linear(32, 32) for _ in range(6)])
    balance = balance_by_time(model, torch.randn(16, 32), 3, repeat=2)
    assert len(balance) == 3 and sum(balance) == 6 and min(balance) >= 1
    assert all(p.grad is None for p in model.parameters())  # profiling leaves no gradients behind
