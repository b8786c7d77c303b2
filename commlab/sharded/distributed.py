"""commlab.ShardedDataParallel: ZeRO stages 1-3 over flat buckets, trained like a torch module.

Usage (every rank)::

    sharded = ShardedDataParallel(model, stage=3, units=list(model.layers))
    opt = torch.optim.AdamW(sharded.parameters(), lr=1e-3)  # the model's parameters, sharded
    for x, y in data:
        opt.zero_grad()
        loss_fn(sharded(x), y).backward()
        opt.step()

Contract, and what is not supported:

- Build the optimizer over ``sharded.parameters()``: the module's own parameters (names, shapes),
  each a DTensor ``Shard(0)`` of this rank's rows, ``.grad`` its rows of the averaged gradient
  (dparams.py); parameter groups, ``clip_grad_norm_``, ``GradScaler`` work. Torch's element-wise
  optimizers; others need ``optimizer.elementwise = True`` (arguments.py); LBFGS, SparseAdam refused.
- In each backward a trainable parameter gets a gradient on every rank or on none: one no rank used
  (an output the loss does not read, a module skipped everywhere) keeps ``.grad`` None, as under
  ``fully_shard``; one some ranks only used is a RuntimeError naming it on every rank at the start
  of that backward (ordering.py; stage 3 gathers a module skipped here too, so no hang comes first).
  Trainable parameters are fixed at construction (requires_grad changed later: a ValueError); stage
  3 shards frozen ones too, as fully_shard. Stage 3 needs each parameter used inside the forward of
  a module holding it or another of its bucket (else a RuntimeError naming the fix, units=[...]).
- Uneven inputs: inside ``with sharded.join():`` a rank out of batches while others run a forward is
  a ValueError on every rank at that iteration (join.py: why no shadowing, as DDP's join does).
- Buffers are not broadcast after construction (nor by fully_shard). ``no_sync()``: full gradients.
- ``algorithm``: "auto" (the default: the ring on Gloo, whose reduce-scatter is an all-reduce, else
  "native"; ``.algorithm`` says which runs), "native" or a p2p algorithm of commlab.collectives with
  a reduce-scatter and an all-gather ("ring"; "halving_doubling" on powers of two), else ValueError.
- ``replicate_group`` (HSDP, hybrid.py; ``Topology.build(..., shard=k)``): replicas of the shards.
- ``bucket_policy``: DDP's (a name or a BucketPolicy, with ``bucket_cap_mb``) unless ``units``.
- ``mixed_precision``: a MixedPrecision or torch's MixedPrecisionPolicy (not ``output_dtype``): fp32
  master shards, gathers and computation in ``param_dtype``, reductions in ``reduce_dtype`` (precision.py).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.optim.optimizer import register_optimizer_step_post_hook

from commlab.ddp.policy import DEFAULT_POLICY, BucketPolicy, make_policy
from commlab.ddp.sync import broadcast_coalesced, verify_param_shapes
from commlab.sharded import arguments, comm, hybrid, ordering, precision, state
from commlab.sharded.buckets import sharded_plan
from commlab.sharded.dparams import ParamSwap, mesh_of
from commlab.sharded.engine import ShardedEngine, gather_after_step_hook
from commlab.sharded.flat_bucket import FlatBucket
from commlab.sharded.join import UnevenInputs, joined
from commlab.sharded.layout import ShardLayout
from commlab.sharded.memory import ShardedMemory, measure
from commlab.sharded.timing import ShardedIterationTiming


class ShardedDataParallel(nn.Module):
    """Sharded data parallelism: ``stage`` 1 shards optimizer state, 2 also gradients, 3 also
    parameters (ZeRO, Rajbhandari et al. 2020). ``bucket_policy`` with ``bucket_cap_mb`` makes the
    buckets as DDP's, unless ``units`` (submodules) makes one bucket per unit with trainable
    parameters plus one for the rest; ``prefetch`` all-gathers run ahead of use (stage 3);
    ``reshard_after_forward`` frees gathered parameters between forward and backward (stage 3)."""

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
        replicate_group: dist.ProcessGroup | None = None,
        bucket_policy: str | BucketPolicy = DEFAULT_POLICY,
        mixed_precision: precision.MixedPrecision | Any = None,
    ):
        super().__init__()
        stage = arguments.check_arguments(module, stage, bucket_cap_mb, prefetch, reshard_after_forward).stage
        self.mixed_precision = precision.resolve(mixed_precision)
        comm.check_algorithm(algorithm)
        policy = make_policy(bucket_policy, bucket_cap_mb=bucket_cap_mb)
        named, plan, trains = sharded_plan(module, policy, units, stage == 3)  # errors before any collective
        if not dist.is_initialized():
            raise RuntimeError("ShardedDataParallel needs an initialised process group (commlab.launch or torchrun)")
        self.stage, self.prefetch, self.reshard_after_forward = stage, prefetch, reshard_after_forward
        self.process_group, self.replicate_group = process_group, replicate_group
        replicas = hybrid.check_groups(process_group, replicate_group)
        rank, world = dist.get_rank(process_group), dist.get_world_size(process_group)
        device_type = next((p.device.type for p in module.parameters()), "cpu")  # one device: plan_buckets
        algorithm = comm.resolve_algorithm(algorithm, dist.get_backend(process_group), device_type)
        for size in (world, replicas):  # the groups' sizes' limits, before the first collective
            comm.check_algorithm(algorithm, size)
        self.algorithm, self.bucket_policy = algorithm, policy  # the algorithm that runs, "auto" resolved
        # Every rank starts from group rank 0's values, as DDP's construction broadcast: with
        # replicas, the shard group's first, then its replica 0's (so every rank (0, 0)'s).
        entries = module.state_dict(keep_vars=True)
        names, tensors = list(entries), list(entries.values())
        for group in [process_group] + ([replicate_group] if replicas > 1 else []):
            verify_param_shapes(names, tensors, group)
            broadcast_coalesced([t.detach() for t in dict.fromkeys(tensors)], group)
        params, self.param_names = [p for _, p in named], [name for name, _ in named]
        self._bucket_params = plan.buckets
        self.mesh = (hybrid.hybrid_mesh(process_group, replicate_group, device_type) if replicas > 1
                     else mesh_of(process_group, device_type))
        buckets = [
            FlatBucket(i, [params[j] for j in idx], rank, world, stage, process_group, algorithm, self.mesh,
                       precision.bucket_dtypes(self.mixed_precision, params[idx[0]].dtype),
                       replicate_group if replicas > 1 else None, trains[i])
            for i, idx in enumerate(plan.buckets)
        ]
        sharded = {id(p) for p in params}
        self._frozen = [p for p in module.parameters() if id(p) not in sharded]
        # The module is no submodule of the wrapper: named_parameters() below gives its names
        # unprefixed, as state_dict() gives its keys.
        object.__setattr__(self, "module", module)
        self._control = ordering.control_groups(process_group, replicate_group if replicas > 1 else None)
        self._engine = ShardedEngine(module, buckets, plan.owners, stage, prefetch, reshard_after_forward,
                                     [[self.param_names[j] for j in idx] for idx in plan.buckets], self._control)
        self._join: UnevenInputs | None = None
        if stage == 3:
            self._engine.free(range(len(buckets)))
            self._engine.peak_gathered = self._engine.last_peak_gathered = 0
        self._swap = ParamSwap(module, [pair for b in buckets for pair in zip(b.params, b.sharded)])
        self._whole_by_shard = {id(shard): whole for b in buckets for whole, shard in zip(b.params, b.sharded)}
        names = {id(p): n for n, p in zip(self.param_names, params)}
        self._requires_grad = [(names[id(p)], dp, b.trains) for b in buckets for p, dp in zip(b.params, b.sharded)]
        self._requires_grad += [(n, p, False) for n, p in module.named_parameters() if id(p) not in sharded]
        self._engine.handles += self._swap.install(module)
        holders = [m for ms in plan.owners for m in ms] + [e[0] for e in self._swap.entries]  # + slots': see dparams
        self._engine.handles += self._swap.install_within(m for m in holders if m is not module)
        shard_ids = {id(dp) for b in buckets for dp in b.sharded}
        # The hook sees sets of ids only: nothing in it may hold the wrapper alive.
        guard = arguments.optimizer_guard(self, sharded, shard_ids)
        weakref.finalize(self, guard.remove)  # the global step pre-hook goes with the wrapper
        if stage < 3:  # the updated shards' all-gathers start at the end of the optimizer step
            post = register_optimizer_step_post_hook(gather_after_step_hook(weakref.ref(self), shard_ids))
            weakref.finalize(self, post.remove)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        changed = [name for name, p, trained in self._requires_grad if p.requires_grad != trained]
        if changed:
            # The buckets, shards and gradient hooks hold the trainable parameters of construction:
            # a parameter frozen since would go on training, one unfrozen would stay as it was.
            raise ValueError(f"requires_grad changed after wrapping for {changed}: ShardedDataParallel fixes the "
                             "trainable parameters when it is built; set requires_grad before wrapping (or wrap again)")
        if self._join is not None:
            self._join.arrive(self._engine)
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
        (commlab/sharded/dparams.py) and at stage 3 the frozen ones, else frozen ones whole."""
        return self.module.named_parameters(prefix, recurse, remove_duplicate)

    def whole_of(self, shard: torch.Tensor) -> torch.Tensor:
        """The whole tensor forward computes with (autograd's leaf) for one of the module's DTensor
        shards; any other tensor (a frozen parameter) as it is."""
        return self._whole_by_shard.get(id(shard), shard)

    def named_buffers(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        return self.module.named_buffers(prefix, recurse, remove_duplicate)

    def named_children(self):
        """The module's children: the wrapper's tree is its module's, so torch's helpers that walk
        it (torch.distributed.checkpoint.state_dict's parameter names) see the module's names."""
        return self.module.named_children()

    @contextmanager
    def _whole(self) -> Iterator[None]:
        """The module's slots hold the whole tensors inside (a full state dict loads into them)."""
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

    join = joined  # ``with sharded.join(): for batch in data: ...`` (commlab/sharded/join.py)

    def train(self, mode: bool = True) -> ShardedDataParallel:
        super().train(mode)
        self.module.train(mode)
        return self

    # --- state --------------------------------------------------------------------------
    def __getattr__(self, name: str) -> Any:
        # The wrapper answers for its module (as fully_shard's module is the model itself), so
        # torch's helpers that walk a state dict's names from the root (torch.distributed.
        # checkpoint.state_dict's FQN lookup) find them.
        try:
            return super().__getattr__(name)
        except AttributeError:
            module = self.__dict__.get("module")
            if module is None:
                raise
            return getattr(module, name)

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:  # type: ignore[override]
        """The module's state dict in its own keys: trainable parameters as this rank's DTensor
        shards (what ``fully_shard``'s state dict holds, so ``torch.distributed.checkpoint`` saves
        each rank's piece), buffers and frozen parameters as they are. No collective here; at
        stages 1-2 the next forward all-gathers the replica from the shards (loaded in place or not)."""
        # Nothing in flight may write the shards' storage once handed out (dcp.load fills it in
        # place), and at stages 1-2 the next forward gathers the replica from them again.
        self._engine.settle(drain=True)
        self._engine.stale = self.stage < 3
        return self.module.state_dict(*args, **kwargs)

    def full_state_dict(self, cpu_offload: bool = False) -> dict[str, torch.Tensor]:
        """The whole module's state dict, gathered a tensor at a time by torch's ``get_model_state_dict``
        (``full_state_dict=True``); ``cpu_offload``: on CPU, rank 0 only. Collective: every rank calls it."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        state.check_full_gather(self.mesh)
        return get_model_state_dict(self, options=StateDictOptions(full_state_dict=True, cpu_offload=cpu_offload))

    def load_state_dict(  # type: ignore[override]
        self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False
    ) -> Any:
        """Load a sharded state dict (DTensor shards on this wrapper's mesh, as :meth:`state_dict`
        gives or ``dcp.load`` fills) or a full one (every rank the same values; missing or
        unexpected keys or a wrong shape raise ValueError before anything changes)."""
        if assign:
            raise ValueError("ShardedDataParallel.load_state_dict copies into its shards: assign=True is not supported")
        if any(isinstance(v, DTensor) for v in state_dict.values()):
            # The values first: a state dict from state_dict() shares the shards' storage (as
            # dcp.load fills it), and at stages 1-2 an all-gather still in flight (launched by an
            # optimizer step, such as the one torch's set_state_dict runs to create the state)
            # would copy the old replica over them when it is waited for.
            values = {k: v.detach().clone() if isinstance(v, torch.Tensor) else v for k, v in state_dict.items()}
            self._engine.settle(drain=True)
            result = self.module.load_state_dict(values, strict=strict)  # copies into the shards
            self._engine.after_step()  # stages 1-2: the replicas gathered from the loaded shards
            return result
        if not strict:
            raise ValueError("a full state dict loads with strict=True only")
        with self._whole():
            state.load_full_state_dict(self.module, self._engine, state_dict)
        return None

    def full_optimizer_state_dict(self, optimizer: torch.optim.Optimizer) -> dict:
        """``optimizer``'s state (built over ``self.parameters()``) as the same optimizer over the
        unsharded module would hold it, loadable there (commlab/sharded/state.py). A
        collective: every rank must call it."""
        return state.full_optimizer_state_dict(optimizer)

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
