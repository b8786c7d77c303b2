"""Which backend and which device a rank uses: torch's rules, with the reason for each choice.

torch's conventions (torch/distributed/run.py docs, torch/nn/parallel/distributed.py): a rank
drives one GPU, ``cuda:LOCAL_RANK`` when the node's GPUs are all visible, or ``cuda:0`` when the
launcher gave each rank its own ``CUDA_VISIBLE_DEVICES``; the current device (``set_device``) is
that GPU, and NCCL's communicator binds to it. NCCL refuses two ranks on one GPU, so
``backend="auto"`` picks NCCL only when every local rank gets a GPU of its own, and otherwise says
which backend it chose and why.
"""

from __future__ import annotations

import os
import warnings

import torch
import torch.distributed as dist


def visible_devices() -> list[str] | None:
    """The entries of CUDA_VISIBLE_DEVICES, or None when it is not set."""
    value = os.environ.get("CUDA_VISIBLE_DEVICES")
    if value is None:
        return None
    return [d.strip() for d in value.split(",") if d.strip()]


def choose_backend(local_world_size: int, n_gpus: int | None = None, nccl: bool | None = None,
                   own_visible: bool | None = None) -> tuple[str, str]:  # fmt: skip
    """("nccl" or "gloo", why) for ``backend="auto"`` on a node running ``local_world_size`` ranks.

    ``n_gpus`` (CUDA devices this process sees), ``nccl`` (NCCL built in) and ``own_visible``
    (CUDA_VISIBLE_DEVICES names exactly one device, i.e. set per rank by the launcher) default to
    this process's values; they are parameters so that the rule is testable without GPUs.
    """
    if n_gpus is None:
        n_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if nccl is None:
        nccl = dist.is_nccl_available()
    if own_visible is None:
        own_visible = visible_devices() is not None and len(visible_devices() or []) == 1
    if n_gpus == 0:
        return "gloo", "no CUDA device is visible"
    if not nccl:
        return "gloo", "this torch build has no NCCL"
    if n_gpus >= local_world_size:
        return "nccl", f"each of the {local_world_size} local ranks gets its own GPU (cuda:LOCAL_RANK of {n_gpus})"
    if own_visible and local_world_size > 1:
        # Only one device visible to this rank: the launcher set CUDA_VISIBLE_DEVICES per rank.
        return "nccl", "CUDA_VISIBLE_DEVICES gives this rank one GPU of its own (cuda:0)"
    return "gloo", (
        f"{local_world_size} local ranks but {n_gpus} visible GPU(s): NCCL needs one GPU per rank "
        "(give each rank its own with CUDA_VISIBLE_DEVICES, or run fewer ranks per node)"
    )


def resolve(backend: str, local_world_size: int, *, per_rank_env: bool = False, say: bool = True) -> str:
    """The backend to use; ``auto`` follows :func:`choose_backend` and warns when it falls back
    to Gloo although a GPU is visible (the silent case users trip on).

    ``per_rank_env``: this process's environment is the rank's own (torchrun), so a single
    device in CUDA_VISIBLE_DEVICES is this rank's own GPU. The local launcher decides for all of
    its children from one environment, where that does not hold.
    """
    chosen, why = choose_backend(local_world_size, own_visible=None if per_rank_env else False)
    if backend == "auto":
        if say and chosen == "gloo" and torch.cuda.is_available():
            warnings.warn(f"backend='auto' chose gloo: {why}", stacklevel=3)
        return chosen
    if backend == "nccl" and chosen != "nccl":
        raise ValueError(f"backend 'nccl' cannot run here: {why}")
    return backend


def rank_device(backend: str, local_rank: int, n_gpus: int | None = None) -> torch.device:
    """The device a rank computes on: for NCCL its own GPU (``cuda:local_rank``, or ``cuda:0``
    when it sees a single device), for Gloo the CPU."""
    if backend != "nccl":
        return torch.device("cpu")
    if n_gpus is None:
        n_gpus = torch.cuda.device_count()
    if n_gpus == 1:
        return torch.device("cuda", 0)
    if local_rank >= n_gpus:
        raise ValueError(f"local rank {local_rank} has no GPU of its own: {n_gpus} visible")
    return torch.device("cuda", local_rank)
