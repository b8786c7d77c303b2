"""A ``fully_shard``-shaped front for commlab.ShardedDataParallel, so torch's FSDP2 tests can run on commlab.

``fully_shard(module, **kw)`` records the module (or each of a list of modules) as a unit and gives
it FSDPModule's class and methods, as torch's does; nothing is sharded yet. The first time a test
touches a recorded module (its forward, ``parameters()``, state dict or gradient-sync switch), the
recorded module that no other recorded module contains becomes the root and is wrapped once:
``commlab.ShardedDataParallel(root, stage=3, units=<the recorded modules inside it>,
reshard_after_forward=..., process_group=mesh.get_group())``. Waiting until then matters because
torch's tests call ``fully_shard`` on the children first and on the root last, and never say
which call is the root.

What a test then sees: the root's forward runs through the wrapper; the root's ``parameters()``
and ``named_parameters()`` are the wrapper's (what commlab's optimizer must hold, as
``model.parameters()`` is what FSDP2's optimizer holds); ``state_dict``/``load_state_dict`` are
the wrapper's full ones; ``set_requires_gradient_sync`` on the root is the wrapper's ``no_sync``.
Everything else FSDPModule offers, and every ``fully_shard`` option commlab has no counterpart for,
raises NotImplementedError naming it, so such a test fails on that line rather than passing on a
silent approximation.
"""

from __future__ import annotations

import os
import weakref
from contextlib import contextmanager

from torch import nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, OffloadPolicy

import commlab

_RECORDED: weakref.WeakValueDictionary[int, nn.Module] = weakref.WeakValueDictionary()
_CLASSES: dict[type, type] = {}
_inside_root = 0  # how many wrapped roots are running their forward now


def unsupported(what: str) -> NotImplementedError:
    return NotImplementedError(f"commlab's fully_shard shim: {what} has no counterpart in commlab.ShardedDataParallel")


def fully_shard(
    module,
    *,
    mesh=None,
    reshard_after_forward=None,
    shard_placement_fn=None,
    mp_policy=MixedPrecisionPolicy(),
    offload_policy=OffloadPolicy(),
    ignored_params=None,
):
    """Record ``module`` (an nn.Module or a list of them) as a unit of the root wrapped later."""
    _log_construction()  # before any refusal: the call reached commlab's shim
    if shard_placement_fn is not None:
        raise unsupported("shard_placement_fn (sharding on a dimension other than a flat 0)")
    if mp_policy != MixedPrecisionPolicy():
        raise unsupported(f"mp_policy={mp_policy}")
    if type(offload_policy) is not OffloadPolicy:
        raise unsupported(f"offload_policy={type(offload_policy).__name__}")
    if ignored_params:
        raise unsupported("ignored_params")
    if reshard_after_forward is not None and not isinstance(reshard_after_forward, bool):
        # torch reshards to a smaller group after forward (fewer ranks to gather from in backward);
        # commlab reshards fully: the same values, gathered from every rank again
        reshard_after_forward = True
    group = None
    if mesh is not None:
        if mesh.ndim != 1:
            raise unsupported(f"a {mesh.ndim}-D mesh (hybrid sharding)")
        group = mesh.get_group()
    # torch's None: reshard every unit but the root; commlab has one switch for the whole wrapper.
    reshard = True if reshard_after_forward is None else reshard_after_forward
    for m in module if isinstance(module, list) else [module]:
        if isinstance(m, _ShimModule):
            raise unsupported("calling fully_shard twice on one module")
        object.__setattr__(m, "_commlab_shim", {"reshard": reshard, "group": group, "wrapper": None, "busy": False, "sync": None})
        if type(m) not in _CLASSES:
            _CLASSES[type(m)] = type(f"CommlabFSDP{type(m).__name__}", (_ShimModule, type(m)), {})
        m.__class__ = _CLASSES[type(m)]
        _RECORDED[id(m)] = m
    return module


def _log_construction() -> None:
    """One line per call in the file the harness reads back: the check that the swap took."""
    path = os.environ.get("COMMLAB_FSDP2_BUILT")
    if path:
        with open(path, "a") as f:
            f.write("commlab\n")


def _contains(outer: nn.Module, inner: nn.Module) -> bool:
    return any(m is inner for m in outer.modules())


def _root_of(module: nn.Module) -> nn.Module:
    recorded = list(_RECORDED.values())
    holders = [r for r in recorded if _contains(r, module)]
    return next(r for r in holders if not any(o is not r and _contains(o, r) for o in holders))


def _wrapped_root(module: nn.Module) -> nn.Module:
    """The root holding ``module``, wrapped (now, if this is the first touch)."""
    root = _root_of(module)
    shim = root._commlab_shim
    if shim["wrapper"] is None:
        units = [m for m in _RECORDED.values() if m is not root and _contains(root, m)]
        with _busy(root):  # commlab reads the module's own parameters while it wraps
            shim["wrapper"] = commlab.ShardedDataParallel(
                root,
                stage=3,
                units=units or None,
                reshard_after_forward=shim["reshard"],
                process_group=shim["group"],
            )
    return root


@contextmanager
def _busy(root: nn.Module):
    """While commlab works on the root, the root's methods are the module's own."""
    root._commlab_shim["busy"] = True
    try:
        yield
    finally:
        root._commlab_shim["busy"] = False


class _ShimModule(FSDPModule):
    """The methods torch's tests call on a module ``fully_shard`` returned."""

    # FSDPModule.__new__ finds the module's own class at this index of the MRO:
    # [CommlabFSDP<Orig>, _ShimModule, FSDPModule, Orig, ...]
    _orig_cls_mro_index = 3

    def _is_root(self) -> bool:
        return _root_of(self) is self

    def _wrapper(self) -> commlab.ShardedDataParallel:
        return _wrapped_root(self)._commlab_shim["wrapper"]

    def __call__(self, *args, **kwargs):
        # The root's call is the wrapper's, whose forward calls the root (its hooks, then its own
        # forward) once; every other call (a unit's, a checkpoint's recomputation, the root's from
        # inside the wrapper) is the module's own, with commlab's hooks doing the gathering.
        global _inside_root
        if _inside_root or _wrapped_root(self) is not self:
            return nn.Module.__call__(self, *args, **kwargs)
        _inside_root += 1
        try:
            return self._commlab_shim["wrapper"](*args, **kwargs)
        finally:
            _inside_root -= 1

    def named_parameters(self, *args, **kwargs):
        shim = self._commlab_shim
        if shim["busy"] or (shim["wrapper"] is None and not self._is_root()):
            return super().named_parameters(*args, **kwargs)
        # The wrapper's parameters are the root's own (DTensor shards in the modules' slots), so
        # wrapping is all it takes; asking the wrapper would come back here through its module.
        _wrapped_root(self)
        return super().named_parameters(*args, **kwargs)

    def parameters(self, recurse: bool = True):
        for _, p in self.named_parameters(recurse=recurse):
            yield p

    def state_dict(self, *args, **kwargs):
        if args or kwargs or self._commlab_shim["busy"] or not self._is_root():  # commlab's own, a parent's, a unit's
            return super().state_dict(*args, **kwargs)
        with _busy(self):
            return self._wrapper().state_dict()

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        if self._commlab_shim["busy"]:
            return super().load_state_dict(state_dict, strict=strict, assign=assign)
        if not self._is_root():
            raise unsupported("load_state_dict on a nested unit")
        with _busy(self):
            return self._wrapper().load_state_dict(state_dict, strict=strict, assign=assign)

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        if not (self._is_root() and recurse):
            raise unsupported("gradient sync switched per unit (no_sync covers the whole wrapper)")
        wrapper, shim = self._wrapper(), self._commlab_shim
        if not requires_gradient_sync and shim["sync"] is None:
            shim["sync"] = wrapper.no_sync()
            shim["sync"].__enter__()
        elif requires_gradient_sync and shim["sync"] is not None:
            shim["sync"].__exit__(None, None, None)
            shim["sync"] = None

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """Nothing to do: commlab completes its reductions at the end of every backward."""

    def _apply(self, *args, **kwargs):
        # FSDPModule's reshards through torch's state first; the module's own is what commlab moves.
        return super(FSDPModule, self)._apply(*args, **kwargs)


def _refusing(name: str):
    def method(self, *args, **kwargs):
        raise unsupported(f"FSDPModule.{name}")

    method.__name__ = name
    return method


for _name, _value in vars(FSDPModule).items():
    if callable(_value) and not _name.startswith("__") and _name not in vars(_ShimModule):
        setattr(_ShimModule, _name, _refusing(_name))
