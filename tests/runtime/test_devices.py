"""Backend and device choice without GPUs: the rules are pure functions."""

import pytest
import torch

from commlab.runtime import devices, resolve_backend


def test_auto_picks_nccl_only_when_every_local_rank_has_its_own_gpu():
    assert devices.choose_backend(2, n_gpus=2, nccl=True, own_visible=False)[0] == "nccl"
    assert devices.choose_backend(4, n_gpus=8, nccl=True, own_visible=False)[0] == "nccl"
    backend, why = devices.choose_backend(2, n_gpus=1, nccl=True, own_visible=False)
    assert backend == "gloo" and "2 local ranks but 1 visible GPU" in why and "CUDA_VISIBLE_DEVICES" in why
    # torchrun with CUDA_VISIBLE_DEVICES set per rank: each rank sees one GPU, its own.
    backend, why = devices.choose_backend(2, n_gpus=1, nccl=True, own_visible=True)
    assert backend == "nccl" and "cuda:0" in why
    no_gpu = devices.choose_backend(1, n_gpus=0, nccl=True, own_visible=False)
    assert no_gpu == ("gloo", "no CUDA device is visible")
    assert devices.choose_backend(1, n_gpus=2, nccl=False, own_visible=False) == ("gloo", "this torch build has no NCCL")


def test_rank_device_follows_torch_conventions():
    assert devices.rank_device("gloo", 3) == torch.device("cpu")
    assert devices.rank_device("nccl", 1, n_gpus=4) == torch.device("cuda", 1)
    assert devices.rank_device("nccl", 1, n_gpus=1) == torch.device("cuda", 0)  # per-rank visibility
    with pytest.raises(ValueError, match="local rank 4 has no GPU of its own: 2 visible"):
        devices.rank_device("nccl", 4, n_gpus=2)


def test_visible_devices_parses_the_environment(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3, 5")
    assert devices.visible_devices() == ["3", "5"]
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert devices.visible_devices() is None


def test_resolve_says_why_it_falls_back_and_refuses_nccl_without_gpus(monkeypatch):
    monkeypatch.setattr(devices, "choose_backend", lambda n, **_: ("gloo", f"{n} local ranks but 1 visible GPU(s)"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.warns(UserWarning, match="backend='auto' chose gloo: 2 local ranks but 1 visible GPU"):
        assert resolve_backend("auto", 2) == "gloo"
    with pytest.raises(ValueError, match="backend 'nccl' cannot run here: 2 local ranks"):
        resolve_backend("nccl", 2)
    with pytest.raises(ValueError, match="unknown backend 'mpi'"):
        resolve_backend("mpi", 2)
    assert resolve_backend("gloo", 2) == "gloo"
