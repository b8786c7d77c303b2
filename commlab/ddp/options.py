"""torch DDP's constructor keywords: what each means for commlab, and a clear error where it cannot.

commlab.DistributedDataParallel takes torch's keywords in torch's positional order (torch 2.13's
``DistributedDataParallel.__init__``); a keyword at torch's default is always accepted. The
functions here turn the rest into commlab's settings, or raise NotImplementedError naming the
keyword when a non-default value asks for something commlab does not do.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch._utils import _get_device_index

# Keywords commlab cannot honour away from their default, with the reason given to the user.
_NOT_IMPLEMENTED = {
    "delay_all_reduce_named_params": (None, "commlab reduces every trainable parameter in buckets"),
    "param_to_hook_all_reduce": (None, "commlab reduces every trainable parameter in buckets"),
    "mixed_precision": (None, "commlab keeps gradients in the parameters' dtype (use a comm hook)"),
    "skip_all_reduce_unused_params": (False, "commlab always reduces locally unused parameters"),
    "bucket_cap_mb_list": (None, "commlab has one cap plus first_bucket_mb"),
}


def refuse_unsupported(**values: Any) -> None:
    """NotImplementedError for the first keyword whose value is not torch's default."""
    if (values["delay_all_reduce_named_params"] is None) != (values["param_to_hook_all_reduce"] is None):
        # torch checks this pairing first, with this error.
        raise ValueError(
            "delay_all_reduce_named_params and param_to_hook_all_reduce need to be set at the same time."
        )
    for name, value in values.items():
        default, why = _NOT_IMPLEMENTED[name]
        if (value is not None) if default is None else bool(value):
            raise NotImplementedError(f"commlab's DistributedDataParallel does not support {name}={value!r}: {why}")


def buffer_sync(broadcast_buffers: bool | None, forward_sync_buffers: bool | None) -> tuple[bool, bool]:
    """(broadcast buffers at construction, broadcast them before every forward), by torch's rule:
    ``forward_sync_buffers`` wins and leaves the construction broadcast on; otherwise the
    deprecated ``broadcast_buffers`` (default True) sets both."""
    if forward_sync_buffers is not None:
        return True, bool(forward_sync_buffers)
    both = True if broadcast_buffers is None else bool(broadcast_buffers)
    return both, both


def warn_check_reduction(check_reduction: bool) -> None:
    """torch ignores check_reduction (its reducer always checks) and warns that it is deprecated."""
    if check_reduction:
        warnings.warn(
            "The `check_reduction` argument in `DistributedDataParallel` module is deprecated. "
            "Please avoid using it.",
            FutureWarning,
            stacklevel=3,
        )


def process_group_from(process_group, device_mesh) -> dist.ProcessGroup:
    """The group to reduce over: the given one, a 1-D device mesh's, or the default (as torch)."""
    if process_group is not None and device_mesh is not None:
        raise RuntimeError("Cannot specify both process_group and device_mesh arguments.")
    if device_mesh is not None:
        if device_mesh.ndim != 1:
            raise RuntimeError(f"Only 1D device mesh is supported, but got {device_mesh}.")
        return device_mesh.get_group(mesh_dim=0)
    return process_group if process_group is not None else dist.group.WORLD


def check_one_device(params: Sequence[torch.Tensor]) -> None:
    """commlab reduces single-device modules only (torch also takes multi-device CUDA modules)."""
    devices = {p.device for p in params}
    if len(devices) != 1:
        raise ValueError(f"all trainable parameters must be on one device, found {sorted(map(str, devices))}")


def device_settings(device_ids, output_device, device: torch.device) -> tuple[list[int] | None, int | None]:
    """(device_ids, output_device) as torch's constructor sets them for a module on ``device``.

    torch keeps them only for a single-device CUDA module; for a CPU module (or none given) both
    are None and naming either is a ValueError -- with torch's truthiness test, so
    ``output_device=0`` passes silently there, as in torch. commlab also refuses a device_ids
    that is not the module's device (torch would move the inputs away from the parameters).
    """
    if device_ids is not None and len(device_ids) > 1:
        raise ValueError("device_ids can only be None or contain a single element.")
    if not device_ids or device.type == "cpu":
        if device_ids or output_device:
            raise ValueError(  # torch's sentence
                "DistributedDataParallel device_ids and output_device arguments only work with "
                "single-device/multiple-device GPU modules or CPU modules, but got device_ids "
                f"{device_ids}, output_device {output_device}, and module parameters {{{device!r}}}."
            )
        return None, None
    ids = [_get_device_index(d, True) for d in device_ids]
    if torch.device(device.type, ids[0]) != device:
        raise ValueError(f"device_ids {list(device_ids)} do not match the module's device {device}")
    return ids, _get_device_index(device_ids[0] if output_device is None else output_device, True)


def comm_groups(round_robin: int | Sequence[dist.ProcessGroup], group: dist.ProcessGroup) -> list:
    """Groups the buckets take in turn (the DDP paper's round-robin process groups, section 3.3)."""
    if not isinstance(round_robin, int):
        groups = list(round_robin)
        if not groups:
            raise ValueError("round_robin_groups must be a positive integer or a non-empty list of groups")
        return groups
    if round_robin < 1:
        raise ValueError(f"round_robin_groups must be >= 1, got {round_robin}")
    if round_robin == 1:
        return [group]
    ranks = dist.get_process_group_ranks(group)
    backend = dist.get_backend(group)
    # Local synchronisation: only the group's own ranks take part, so this also works for a
    # data-parallel subgroup inside a larger (e.g. pipeline x data) job.
    return [dist.new_group(ranks, backend=backend, use_local_synchronization=True) for _ in range(round_robin)]


def side_stream_copies() -> bool:
    """torch's use_side_stream_for_tensor_copies: inputs are copied to the GPU on a side stream
    unless PYTORCH_DDP_USE_SIDE_STREAM is set to something other than 1."""
    return os.environ.get("PYTORCH_DDP_USE_SIDE_STREAM", "1") == "1"
