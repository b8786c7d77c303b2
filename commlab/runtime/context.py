"""The Runtime: one explicit object that says who this rank is and where it computes.

commlab never keeps process-group state in module globals. Code that needs the rank, the world
size, the backend or the device takes a :class:`Runtime` argument; the object is built once per
process (by :func:`commlab.launch` or, under torchrun, by :func:`init_from_env`) and passed down.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from commlab.runtime import devices

BACKENDS = ("gloo", "nccl")


@dataclass(frozen=True)
class Runtime:
    """Where this process sits in the job: rank, world size, backend and compute device."""

    rank: int
    world_size: int
    local_rank: int
    backend: str
    device: torch.device
    group: dist.ProcessGroup | None = None  # None: the default (world) group

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @classmethod
    def current(cls, group: dist.ProcessGroup | None = None) -> Runtime:
        """Describe this process from the initialised torch.distributed state.

        With NCCL each rank computes on the current CUDA device, its own GPU (set by
        :func:`commlab.launch` / :func:`init_from_env` from the local rank); with Gloo on the CPU.
        """
        if not dist.is_initialized():
            raise RuntimeError(
                "torch.distributed is not initialised: run inside commlab.launch(...) "
                "or call commlab.init_from_env() under torchrun"
            )
        backend = str(dist.get_backend(group)).lower()
        local_rank = int(os.environ.get("LOCAL_RANK", dist.get_rank()))
        if backend == "nccl":  # the current device, which launch / init_from_env set (as torch)
            device = torch.device("cuda", torch.cuda.current_device())
        else:
            device = torch.device("cpu")
        return cls(
            rank=dist.get_rank(group),
            world_size=dist.get_world_size(group),
            local_rank=local_rank,
            backend=backend,
            device=device,
            group=group,
        )


def resolve_backend(backend: str, world_size: int) -> str:
    """Map "auto" to NCCL when every local rank can have its own GPU, else Gloo (with a warning
    that says why when a GPU is visible; rules in :mod:`commlab.runtime.devices`).

    Raises ValueError for unknown names and for NCCL without a GPU per rank, so that bad input
    fails before any process starts.
    """
    backend = backend.lower()
    if backend != "auto" and backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}: choose from auto, {', '.join(BACKENDS)}")
    return devices.resolve(backend, world_size)


def under_torchrun() -> bool:
    """True when torchrun (or SLURM + torchrun) has set this process's rank in the environment."""
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def init_from_env(backend: str = "auto", timeout: float = 300.0) -> Runtime:
    """Initialise the default process group from torchrun's environment and return the Runtime.

    A no-op on the process group if it is already initialised.
    """
    if not dist.is_initialized():
        world_size = int(os.environ["WORLD_SIZE"])
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
        if backend.lower() != "auto" and backend.lower() not in BACKENDS:
            raise ValueError(f"unknown backend {backend!r}: choose from auto, {', '.join(BACKENDS)}")
        chosen = devices.resolve(backend.lower(), local_world, per_rank_env=True)
        if chosen == "nccl":
            torch.cuda.set_device(devices.rank_device(chosen, int(os.environ.get("LOCAL_RANK", 0))))
        dist.init_process_group(
            chosen, init_method="env://", timeout=datetime.timedelta(seconds=timeout)
        )
    return Runtime.current()
