"""commlab.ShardedDataParallel: ZeRO stages 1-3 over flat buckets, trained like a torch module.

Usage (every rank)::

    sharded = ShardedDataParallel(model, stage=3, units=list(model.layers))
    opt = torch.optim.AdamW(sharded.parameters(), lr=1e-3)  # the model's parameters, sharded
    for x, y in data:
        opt.zero_grad()
        loss_fn(sharded(x), y).backward()
        opt.step()

Contract, and what is not supported:

- Build the optimizer over ``sharded.parameters()`` (or ``sharded.module.parameters()``, the
  same objects): the module's own parameters in their names and shapes, each a DTensor ``Shard(0)``
  holding this rank's rows, whose ``.grad`` is this rank's rows of the averaged gradient
  (commlab/sharded/dparams.py); parameter groups, ``clip_grad_norm_`` and ``GradScaler`` work on
  them. Optimizers: torch's element-wise ones; any other class must declare
  ``optimizer.elementwise = True`` (commlab/sharded/arguments.py says why), LBFGS and SparseAdam
  are refused.
- Every trainable parameter must receive a gradient in every backward (else a RuntimeError at
  the end of backward), and stage 3 needs each parameter used inside the forward of a module
  that holds it, of its unit, or of a module holding another parameter of its bucket (else a
  RuntimeError naming the fix: nn.MultiheadAttention reads its out_proj's weight itself, so a
  bucket size that separates them needs units).
- The module's buffers are not broadcast after construction (torch's fully_shard does not either).
- ``no_sync()`` accumulates the full gradients of the whole model on every rank (the memory of
  unsharded gradients, as DDP holds) until the next synchronised backward reduces them.
- ``algorithm``: "auto" (the default: the ring on Gloo, where the backend's reduce-scatter is an
  all-reduce of the whole buffer, else "native"; ``.algorithm`` says which runs), "native" (the
  backend's reduce-scatter, all-gather and all-reduce) or a p2p
  algorithm of commlab.collectives that provides a reduce-scatter and an all-gather ("ring", or
  "halving_doubling" on a power-of-two world size); others are refused with a ValueError naming
  those that do (commlab/sharded/comm.py), before any collective.
- ``bucket_policy``: DDP's (commlab/ddp/policy.py; a registered name or a BucketPolicy, built with
  ``bucket_cap_mb``) decides which parameters share a bucket unless ``units`` is given
  (commlab/sharded/buckets.py says which of the policy's questions it asks).
- ``mixed_precision``: a MixedPrecision or torch's MixedPrecisionPolicy (its ``output_dtype``
  refused): fp32 shards as the master the optimizer steps, gathers and computation in
  ``param_dtype``, reductions in ``reduce_dtype``, at every stage (commlab/sharded/precision.py).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook

from commlab.ddp.policy import DEFAULT_POLICY, BucketPolicy, make_policy
from commlab.ddp.sync import broadcast_coalesced, verify_param_shapes
from commlab.sharded import arguments, comm, precision, state
from commlab.sharded.buckets import plan_buckets, trainable
from commlab.sharded.dparams import ParamSwap, mesh_of
from commlab.sharded.engine import ShardedEngine, gather_after_step_hook
from commlab.sharded.flat_bucket import FlatBucket
from commlab.sharded.layout import ShardLayout
from commlab.sharded.memory import ShardedMemory, measure
from commlab.sharded.optim_state import full_optimizer_state_dict
from commlab.sharded.timing import ShardedIterationTiming


class ShardedDataParallel(nn.Module):
    """Sharded data parallelism: ``stage`` 1 shards optimizer state, 2 also gradients, 3 also
    parameters (ZeRO, Rajbhandari et al. 2020). ``bucket_policy`` with ``bucket_cap_mb`` makes the
    buckets as DDP's, unless ``units`` (submodules) makes one bucket per unit plus one for the rest; ``prefetch``
    all-gathers run ahead of use (stage 3); ``reshard_after_forward`` frees gathered parameters
    between forward and backward (stage 3)."""

    def __init__(
        self,
        module: nn.Module,
        *,
        stage: int = 3,
        bucket_cap_mb: float = 25,
        units: Sequence[nn.Module] | None = None,
        prefetch: int = 1,
        reshard_after_forward: bool = True,
        algorithm: str = comm.AUTO,
        process_group: dist.ProcessGroup | None = None,
        bucket_policy: str | BucketPolicy = DEFAULT_POLICY,
        mixed_precision: precision.MixedPrecision | Any = None,
    ):
        super().__init__()
        stage = arguments.check_arguments(module, stage, bucket_cap_mb, prefetch, reshard_after_forward).stage
        self.mixed_precision = precision.resolve(mixed_precision)
        comm.check_algorithm(algorithm)
        policy = make_policy(bucket_policy, bucket_cap_mb=bucket_cap_mb)
        plan = plan_buckets(module, policy, units)  # unit and policy errors, still before any collective
        if not dist.is_initialized():
            raise RuntimeError("ShardedDataParallel needs an initialised process group (commlab.launch or torchrun)")
        self.stage, self.prefetch, self.reshard_after_forward = stage, prefetch, reshard_after_forward
        self.process_group = process_group
        rank, world = dist.get_rank(process_group), dist.get_world_size(process_group)
        device_type = next((p.device.type for p in module.parameters()), "cpu")  # one device: plan_buckets
        algorithm = comm.resolve_algorithm(algorithm, dist.get_backend(process_group), device_type)
        comm.check_algorithm(algorithm, world)  # the world size's limits, before the first collective
        self.algorithm, self.bucket_policy = algorithm, policy  # the algorithm that runs, "auto" resolved
        # Every rank starts from group rank 0's values, as DDP's construction broadcast.
        entries = module.state_dict(keep_vars=True)
        names, tensors = list(entries), list(entries.values())
        verify_param_shapes(names, tensors, process_group)
        broadcast_coalesced([t.detach() for t in dict.fromkeys(tensors)], process_group)
        params = [p for _, p in trainable(module)]
        self.param_names = [name for name, _ in trainable(module)]
        self._bucket_params = plan.buckets
        self.mesh = mesh_of(process_group, device_type)
        buckets = [
            FlatBucket(i, [params[j] for j in idx], rank, world, stage, process_group, algorithm, self.mesh,
                       precision.bucket_dtypes(self.mixed_precision, params[idx[0]].dtype))
            for i, idx in enumerate(plan.buckets)
        ]
        sharded = {id(p) for p in params}
        self._frozen = [p for p in module.parameters() if id(p) not in sharded]
        # The module is no submodule of the wrapper: named_parameters() below gives its names
        # unprefixed, as state_dict() gives its keys.
        object.__setattr__(self, "module", module)
        self._engine = ShardedEngine(module, buckets, plan.owners, stage, prefetch, reshard_after_forward)
        if stage == 3:
            self._engine.free(range(len(buckets)))
            self._engine.peak_gathered = self._engine.last_peak_gathered = 0
        self._swap = ParamSwap(module, [pair for b in buckets for pair in zip(b.params, b.sharded)])
        self._engine.handles += self._swap.install(module)
        self._engine.handles += self._swap.install_within(m for ms in plan.owners for m in ms if m is not module)
        shard_ids = {id(dp) for b in buckets for dp in b.sharded}
        # The hook sees sets of ids only: nothing in it may hold the wrapper alive.
        guard = arguments.optimizer_guard(self, sharded, shard_ids)
        weakref.finalize(self, guard.remove)  # the global step pre-hook goes with the wrapper
        if stage < 3:  # the updated shards' all-gathers start at the end of the optimizer step
            post = register_optimizer_step_post_hook(gather_after_step_hook(weakref.ref(self), shard_ids))
            weakref.finalize(self, post.remove)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        args, kwargs = precision.cast_inputs(self.mixed_precision, args, kwargs)
        self._engine.before_forward()
        try:
            return self.module(*args, **kwargs)
        except RuntimeError as e:
            if self.stage == 3 and "storage of size 0" in str(e):
                # A freed parameter was read: its holder's forward did not run around the use.
                raise RuntimeError(
                    "stage 3 found a parameter used outside the forward of the module holding it "
                    "(as nn.MultiheadAttention uses its out_proj's weight): group the user and the "
                    "holder in one unit (units=[...]) or in one bucket (a larger bucket_cap_mb)"
                ) from e
            raise
        finally:
            self._engine.after_forward()

    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        """The module's own parameters, names and shapes: DTensor shards for the trainable ones
        (commlab/sharded/dparams.py), frozen ones as they are (replicated)."""
        return self.module.named_parameters(prefix, recurse, remove_duplicate)

    @contextmanager
    def _whole(self) -> Iterator[None]:
        """The module's slots hold the whole tensors inside (state dicts read and write them)."""
        self._swap.to_whole()
        try:
            yield
        finally:
            self._swap.to_sharded()

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate full gradients locally, without communication (each
        rank then holds the whole model's gradients, DDP's memory); the first backward outside
        reduces the sum."""
        previous, self._engine.sync = self._engine.sync, False
        try:
            yield
        finally:
            self._engine.sync = previous

    def train(self, mode: bool = True) -> ShardedDataParallel:
        super().train(mode)
        self.module.train(mode)
        return self

    # --- state --------------------------------------------------------------------------
    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, torch.Tensor]:  # type: ignore[override]
        """The wrapped module's full state dict (keys as the unwrapped module's). Stage 3 and a
        stepped stage 1-2 gather: every rank must call it."""
        if args or kwargs:
            raise ValueError("ShardedDataParallel.state_dict() takes no arguments; it gives the full module state dict")
        with self._whole():
            return state.full_state_dict(self.module, self._engine)

    def load_state_dict(  # type: ignore[override]
        self, state_dict: Mapping[str, torch.Tensor], strict: bool = True, assign: bool = False
    ) -> None:
        """Load a full module state dict (every rank the same); missing or unexpected keys or a
        wrong shape raise ValueError before anything changes."""
        if not strict or assign:
            raise ValueError("ShardedDataParallel.load_state_dict supports strict=True, assign=False only")
        with self._whole():
            state.load_full_state_dict(self.module, self._engine, state_dict)

    def full_optimizer_state_dict(self, optimizer: torch.optim.Optimizer) -> dict:
        """``optimizer``'s state (built over ``self.parameters()``) as the same optimizer over the
        unsharded module would hold it, loadable there (commlab/sharded/optim_state.py). A
        collective: every rank must call it."""
        return full_optimizer_state_dict(optimizer)

    # --- what can be read ----------------------------------------------------------------
    @property
    def layouts(self) -> list[ShardLayout]:
        return [b.layout for b in self._engine.buckets]

    @property
    def bucket_names(self) -> list[list[str]]:
        """Parameter names of each bucket, in forward order."""
        return [[self.param_names[i] for i in idx] for idx in self._bucket_params]

    @property
    def iteration_timings(self) -> list[ShardedIterationTiming]:
        return list(self._engine.recorder.iterations)

    def memory(self, optimizer: torch.optim.Optimizer | None = None) -> ShardedMemory:
        """This rank's bytes now (commlab/sharded/memory.py); optimizer state when given it."""
        return measure(self._engine, self._frozen, optimizer)

    @property
    def buckets(self) -> list[FlatBucket]:
        return self._engine.buckets
