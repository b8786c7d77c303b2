"""commlab.launch: results in rank order, tracebacks from failing ranks, no hang, loopback only."""

import os
import time

import pytest
import torch
import torch.distributed as dist

import commlab
from commlab.runtime import LaunchError, resolve_backend


def _describe(scale):
    rt = commlab.Runtime.current()
    t = torch.tensor([float(rt.rank + 1)])
    dist.all_reduce(t)
    return {
        "rank": rt.rank,
        "world": rt.world_size,
        "local_rank": rt.local_rank,
        "backend": rt.backend,
        "device": str(rt.device),
        "sum": t.item() * scale,
        "ifname": os.environ.get("GLOO_SOCKET_IFNAME"),
    }


def _fail_on_rank1():
    if dist.get_rank() == 1:
        raise ValueError("boom from rank one")
    dist.barrier()  # rank 0 would block here forever without the launcher's cleanup


def _sleep_forever():
    time.sleep(3600)


def _exit_hard():
    if dist.get_rank() == 0:
        os._exit(3)
    time.sleep(3600)


@pytest.mark.slow
def test_launch_results_in_rank_order():
    out = commlab.launch(_describe, 2.0, world_size=3, backend="gloo", timeout=60)
    assert [o["rank"] for o in out] == [0, 1, 2]
    assert all(o["world"] == 3 and o["backend"] == "gloo" and o["device"] == "cpu" for o in out)
    assert [o["local_rank"] for o in out] == [0, 1, 2]
    assert all(o["sum"] == 12.0 for o in out)  # (1 + 2 + 3) * 2
    assert all(o["ifname"] == "lo" for o in out)


@pytest.mark.slow
def test_failing_rank_raises_with_its_traceback_and_does_not_hang():
    start = time.monotonic()
    with pytest.raises(LaunchError) as info:
        commlab.launch(_fail_on_rank1, world_size=2, backend="gloo", timeout=60)
    assert "boom from rank one" in str(info.value)
    assert info.value.rank == 1
    assert time.monotonic() - start < 50  # well before the process-group timeout


@pytest.mark.slow
def test_hanging_and_dying_ranks_end_within_timeout():
    start = time.monotonic()
    with pytest.raises(LaunchError, match="did not finish within"):
        commlab.launch(_sleep_forever, world_size=2, backend="gloo", timeout=8)
    assert time.monotonic() - start < 30
    with pytest.raises(LaunchError, match="exited with code 3"):
        commlab.launch(_exit_hard, world_size=2, backend="gloo", timeout=60)


def test_bad_input_fails_before_spawning():
    with pytest.raises(ValueError, match="world_size"):
        commlab.launch(_describe, 1.0, world_size=0, backend="gloo")
    with pytest.raises(ValueError, match="unknown backend"):
        resolve_backend("mpi-ish", 2)
    with pytest.raises(ValueError, match="timeout"):
        commlab.launch(_describe, 1.0, world_size=2, timeout=0)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA device"):
            resolve_backend("nccl", 2)
    assert resolve_backend("auto", 2) in ("gloo", "nccl")


def _death_signal():
    import ctypes

    from commlab.runtime import rank_entry

    sig = ctypes.c_int()
    ctypes.CDLL("libc.so.6").prctl(2, ctypes.byref(sig))  # PR_GET_PDEATHSIG
    return rank_entry.torch_loaded_at_pdeathsig, sig.value


@pytest.mark.slow
def test_a_rank_dies_with_its_parent_and_says_so_before_torch_loads():
    import signal

    torch_loaded, sig = commlab.launch(_death_signal, world_size=1, backend="gloo", timeout=60)[0]
    assert sig == signal.SIGKILL
    assert torch_loaded is False  # the signal was set before the seconds-long torch import


def test_a_rank_that_exits_before_reporting_is_explained():
    from commlab.runtime.launch import exit_reason

    assert "out-of-memory killer" in exit_reason(1, -9)
    assert "segmentation fault" in exit_reason(0, -11)
    assert "sys.exit(0) or os._exit(0)" in exit_reason(0, 0)
    assert "os._exit(3)" in exit_reason(2, 3) and "rank 2 exited with code 3 before reporting" in exit_reason(2, 3)
