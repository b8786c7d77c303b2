"""Threads per rank: one rule (commlab/runtime/threads.py) for the ranks, the profiles and calibration."""

import os

import pytest
import torch

from commlab.runtime.threads import rank_threads, threads_per_rank, use_rank_threads


def test_the_rule_in_order_fixed_then_omp_then_cores_shared_out():
    assert threads_per_rank(2, cores=16, environ={}) == 8
    assert threads_per_rank(3, cores=16, environ={}) == 5  # rounded down
    assert threads_per_rank(4, cores=2, environ={}) == 1  # at least one
    assert threads_per_rank(2, cores=16, environ={"OMP_NUM_THREADS": "3"}) == 3
    assert threads_per_rank(2, cores=16, environ={"OMP_NUM_THREADS": ""}) == 8  # empty: not set
    assert threads_per_rank(2, 5, cores=16, environ={"OMP_NUM_THREADS": "3"}) == 5
    assert threads_per_rank(2, None, cores=16, environ={}) == 8  # no fixed count: the rule
    with pytest.raises(ValueError, match="local_ranks"):
        threads_per_rank(0, cores=16, environ={})


def test_the_defaults_are_this_machine_and_this_environment(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert threads_per_rank(1) == max(1, os.cpu_count() or 1)
    monkeypatch.setenv("OMP_NUM_THREADS", "7")
    assert threads_per_rank(1) == 7


def test_a_profile_runs_with_a_rank_s_threads_and_gives_the_parent_s_back(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        with rank_threads(2) as inside:
            assert inside == torch.get_num_threads() == 1
        assert torch.get_num_threads() == 2
        with rank_threads(2, fixed=3):
            assert torch.get_num_threads() == 3
        assert use_rank_threads(1) == 2 and torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
