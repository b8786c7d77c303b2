"""Calibration's device and clock: the CPU path here, the GPU path where a GPU is present.

The calibration code is one path; only the device (the model, batch and buffers) and the clock
(perf_counter or CUDA events) differ, and those are chosen by commlab/costmodel/calibration/devicetime.py.
The selection is tested everywhere; the GPU calibration runs only with CUDA (scripts/gpu_check.py).
"""

import time

import pytest
import torch

from commlab.costmodel.calibration.devicetime import (
    allocator_state,
    calibration_device,
    clock_for,
    timed,
    to_device,
)
from commlab.ddp.timing import CpuClock, CudaClock

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs a CUDA device (run scripts/gpu_check.py on a GPU machine)")


def test_device_and_clock_selection():
    assert calibration_device("gloo") == torch.device("cpu")
    assert calibration_device("nccl", current=1) == torch.device("cuda", 1)  # the launcher's current device
    assert isinstance(clock_for(torch.device("cpu")), CpuClock)
    assert isinstance(clock_for(torch.device("cuda", 0)), CudaClock)  # choosing it needs no GPU
    assert allocator_state(torch.device("cpu")) == {}


def test_the_cpu_clock_times_what_it_runs_and_tensors_move_whole():
    seconds = timed(clock_for(torch.device("cpu")), lambda: time.sleep(0.02))
    assert 0.015 < seconds < 2.0
    x, y = torch.ones(2), torch.zeros(3)
    moved = to_device((x, [y, "label"]), torch.device("cpu"))
    assert isinstance(moved, tuple) and isinstance(moved[1], list) and moved[1][1] == "label"
    assert torch.equal(moved[0], x) and moved[1][0].device.type == "cpu"


@pytest.mark.gpu
@needs_cuda
def test_cuda_events_time_the_gpu_not_the_host():
    """A kernel that spins on the GPU: the host returns at once, the events measure the spin."""
    device = torch.device("cuda", torch.cuda.current_device())
    clock = clock_for(device)
    torch.cuda.synchronize()
    host = time.perf_counter()
    gpu = timed(clock, lambda: torch.cuda._sleep(200_000_000))  # ~0.1 s at 2 GHz
    assert gpu > 0.01
    torch.cuda.synchronize()
    assert time.perf_counter() - host >= gpu * 0.9  # the synchronized wall time covers it


@pytest.mark.gpu
@needs_cuda
@pytest.mark.slow
def test_gpu_calibration_measures_on_the_device(tmp_path):
    """One NCCL rank calibrates a small MLP: everything on the GPU, CUDA-event times, allocator state."""
    from commlab.costmodel.calibration.driver import Workload, calibrate

    entry = calibrate(Workload("mlp", "depth=2,width=256", 16), backend="nccl", world_size=1,
                      algorithms=("native",), timeout=300.0)
    c = entry["compute"]
    assert c["device"].startswith("cuda")
    assert c["allocator"]["reserved_bytes"] > 0 and c["allocator"]["ooms"] == 0
    assert c["forward_s"] > 0 and c["ready_s"][-1] > 0 and c["optimizer_s"] > 0
    assert all(t > 0 for t in entry["collectives"]["native"]["seconds"])
    assert "steady" in entry["steadiness"]
