"""Run commlab's CUDA tests on a GPU machine and print what they did.

    python scripts/gpu_check.py            # all GPU tests (pytest -m gpu) + an environment line

Covers: world size 1 on NCCL (comm streams, events, CUDA-event timings, DDP vs torch DDP), world
size 2 with both ranks on one GPU over Gloo with CUDA tensors (DDP vs torch DDP, timings ordered
ready <= launched <= done), the 2-GPU NCCL tests when two GPUs are visible, and the cost model's
calibration on the GPU (model, batch and buffers on the device, CUDA-event timing, the caching
allocator's state: tests/costmodel/calibration/test_devicetime.py; its collectives queued back to
back behind a spin: tests/test_gpu.py). Exits with pytest's status;
without a GPU it says so and exits 2 (nothing ran).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
TESTS = [
    "tests/test_gpu.py",
    "tests/ddp/test_ddp.py",
    "tests/collectives/test_all_reduce.py",
    "tests/costmodel/calibration/test_devicetime.py",
    "tests/test_memtrack.py",
]


def main() -> int:
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device visible; nothing ran")
        return 2
    names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, NCCL {torch.cuda.nccl.version()}, devices {names}")
    command = [sys.executable, "-m", "pytest", "-v", "-rs", "-m", "gpu", *TESTS]
    print("running:", " ".join(command), flush=True)
    return subprocess.call(command, cwd=ROOT)


if __name__ == "__main__":
    sys.exit(main())
