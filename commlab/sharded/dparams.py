"""The model's own parameters as DTensor shards, and the swap to whole tensors for computation.

After wrapping, every trainable parameter of the module is an ``nn.Parameter`` holding a
``DTensor`` with ``Shard(0)`` on a 1-D ``DeviceMesh`` over the wrapper's process group, in the
parameter's own name and shape, whose local tensor is this rank's rows (a view into the bucket's
storage, commlab/sharded/layout.py). This is torch's ``fully_shard`` representation
(torch/distributed/fsdp/_fully_shard/_fsdp_param.py): optimizers, parameter groups by name or
``ndim``, ``clip_grad_norm_`` (a norm over Shard(0) DTensors is reduced over the mesh) and
GradScaler (DTensor all-reduces ``found_inf``: torch/distributed/tensor/_dispatch.py) see the
whole parameter's meaning while holding a piece.

Computation runs on the whole tensors (views into the bucket's gathered buffer). The root
module's forward pre-hook puts them in the modules' parameter slots, its forward hook puts the
DTensors back, as fully_shard swaps ``to_unsharded``/``to_sharded``; autograd keeps what the
forward saved, so backward needs no swap. A unit's forward that runs outside the root's (called
on its own, or again in backward by activation checkpointing) swaps its own slots around itself.
A tied parameter is one parameter held by several modules: every slot holding it is swapped.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard


def mesh_of(group: dist.ProcessGroup | None, device_type: str) -> DeviceMesh:
    """The 1-D mesh over ``group`` (None: the default group), without a new process group."""
    return DeviceMesh.from_group(group if group is not None else dist.group.WORLD, device_type)


def as_dtensor(local: torch.Tensor, mesh: DeviceMesh, like: torch.Tensor) -> DTensor:
    """``local`` (this rank's rows) as the Shard(0) piece of a tensor shaped as ``like``, replicated
    over a 2-D mesh's first (replicate) dimension (commlab/sharded/hybrid.py); shape and stride
    given, so no collective checks them."""
    placements = [Shard(0)] if mesh.ndim == 1 else [Replicate(), Shard(0)]
    return DTensor.from_local(local, mesh, placements, run_check=False, shape=like.shape, stride=like.stride())


def slots_of(module: nn.Module) -> dict[int, list[tuple[nn.Module, str]]]:
    """For each parameter (by id), every (module, attribute name) holding it, tied ones included."""
    result: dict[int, list[tuple[nn.Module, str]]] = {}
    for m in module.modules():
        for name, p in m._parameters.items():
            if p is not None:
                result.setdefault(id(p), []).append((m, name))
    return result


class ParamSwap:
    """The modules' parameter slots and, for each, the whole tensor and the DTensor shard."""

    def __init__(self, module: nn.Module, pairs: list[tuple[nn.Parameter, nn.Parameter]]):
        slots = slots_of(module)
        self.entries = [(m, name, whole, shard) for whole, shard in pairs for m, name in slots[id(whole)]]
        self.sharded = False

    def to_sharded(self) -> None:
        # Written into _parameters directly (as fully_shard's unsafe_setattr_param): setattr
        # would run nn.Module's checks for every slot on every forward.
        for m, name, _, shard in self.entries:
            m._parameters[name] = shard
        self.sharded = True

    def to_whole(self) -> None:
        for m, name, whole, _ in self.entries:
            m._parameters[name] = whole
        self.sharded = False

    def install(self, root: nn.Module) -> list:
        """Hooks on ``root`` that swap around each forward; returns their handles."""

        def before(module, args):
            self.to_whole()

        def after(module, args, output):
            self.to_sharded()

        self.to_sharded()
        return [root.register_forward_pre_hook(before, prepend=True),
                root.register_forward_hook(after, always_call=True)]

    def install_within(self, modules) -> list:
        """Hooks on each of ``modules`` that give it the whole tensors for a forward that runs while
        the slots hold the shards: outside the root's forward, a submodule called on its own or
        recomputed in backward by activation checkpointing (fully_shard's pre-forward hook
        unshards every unit the same way). The wrapper passes its units and every module holding
        a slot: ``checkpoint_wrapper`` recomputes the unit's inner module, whose hooks are not the
        unit's. Returns their handles."""
        handles = []
        for module in {id(m): m for m in modules}.values():
            inside = {id(m) for m in module.modules()}
            mine = [e for e in self.entries if id(e[0]) in inside]
            swapped: list[bool] = []  # per call in progress: did it swap (calls nest by recursion)

            def before(mod, args, mine=mine, swapped=swapped):
                # The slots' own state, not the flag: an enclosing unit may have swapped them already.
                now = self.sharded and any(m._parameters[name] is shard for m, name, _, shard in mine)
                if now:
                    for m, name, whole, _ in mine:
                        m._parameters[name] = whole
                swapped.append(now)

            def after(mod, args, output, mine=mine, swapped=swapped):
                if swapped.pop():
                    for m, name, _, shard in mine:
                        m._parameters[name] = shard

            handles += [module.register_forward_pre_hook(before, prepend=True),
                        module.register_forward_hook(after, always_call=True)]
        return handles
