"""commlab.DistributedDataParallel: torch's DDP interface over the Python reducer in reducer.py."""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.join import Join, Joinable
from torch.distributed.utils import _to_kwargs

from commlab import collectives
from commlab.ddp import dist_autograd
from commlab.ddp import join as uneven
from commlab.ddp import options
from commlab.ddp.logging_data import DDPLogging
from commlab.ddp.policy import DEFAULT_POLICY, BucketPolicy, make_policy
from commlab.ddp.outputs import find_tensors, through_sink
from commlab.ddp.reducer import Reducer
from commlab.ddp.sparse import sparse_parameters, sparse_reducer
from commlab.ddp.sync import broadcast_coalesced, verify_param_shapes
from commlab.ddp.timing import IterationTiming
from commlab.ddp.torch_private import TorchPrivateAPI


class DistributedDataParallel(TorchPrivateAPI, nn.Module, Joinable):
    """Data parallelism with bucketed gradient all-reduce that overlaps backward.

    torch's arguments in torch's order with torch's defaults (commlab/ddp/options.py says which
    non-default values are refused), plus, keyword-only: ``algorithm`` (a name from ``commlab.collectives.algorithm_names()``) runs each bucket's
    all-reduce; ``overlap=False`` reduces every bucket only after backward (the DDP paper's
    non-overlapped baseline); ``first_bucket_mb`` overrides the small first bucket's cap;
    ``round_robin_groups=k`` (or a list of process groups) gives consecutive buckets to k groups
    in turn, so that their all-reduces may run concurrently; ``bucket_policy`` (a name from
    ``commlab.ddp.policy.policy_names()`` or a BucketPolicy) decides which gradients share a bucket.
    """

    def __init__(
        self,
        module: nn.Module,
        device_ids: Sequence[int | torch.device] | None = None,
        output_device: int | torch.device | None = None,
        dim: int = 0,
        broadcast_buffers: bool | None = None,
        init_sync: bool = True,
        process_group: dist.ProcessGroup | None = None,
        bucket_cap_mb: float | None = None,
        find_unused_parameters: bool = False,
        check_reduction: bool = False,
        gradient_as_bucket_view: bool = False,
        static_graph: bool = False,
        delay_all_reduce_named_params: Any = None,
        param_to_hook_all_reduce: Any = None,
        mixed_precision: Any = None,
        device_mesh: Any = None,
        skip_all_reduce_unused_params: bool = False,
        bucket_cap_mb_list: list[int] | None = None,
        batched_grad_copy: bool = False,
        forward_sync_buffers: bool | None = None,
        *,
        algorithm: str = "native",
        overlap: bool = True,
        first_bucket_mb: float | None = None,
        round_robin_groups: int | Sequence[dist.ProcessGroup] = 1,
        bucket_policy: str | BucketPolicy = DEFAULT_POLICY,
    ):
        # What __setstate__ rebuilds from (pickling, copy.deepcopy), as torch rebuilds its reducer.
        settings = {k: v for k, v in locals().items() if k not in ("self", "module", "__class__")}
        super().__init__()
        self._settings = settings
        Joinable.__init__(self)
        self._divide_by_initial_world_size = True
        if not isinstance(module, nn.Module):
            raise ValueError(f"module must be an nn.Module, got {type(module).__name__}")
        options.refuse_unsupported(
            delay_all_reduce_named_params=delay_all_reduce_named_params,
            param_to_hook_all_reduce=param_to_hook_all_reduce,
            mixed_precision=mixed_precision,
            skip_all_reduce_unused_params=skip_all_reduce_unused_params,
            bucket_cap_mb_list=bucket_cap_mb_list,
        )
        if algorithm not in collectives.algorithm_names():
            raise ValueError(
                f"unknown all-reduce algorithm {algorithm!r}: choose from {', '.join(collectives.algorithm_names())}"
            )
        # The policy holds the caps in bytes (the one conversion); bucket_bytes_cap reads them there.
        policy = make_policy(bucket_policy, bucket_cap_mb=bucket_cap_mb, first_bucket_mb=first_bucket_mb)
        if not dist.is_initialized():
            raise RuntimeError("DistributedDataParallel needs an initialised process group (use commlab.launch)")
        options.warn_check_reduction(check_reduction)
        # torch's _ddp_params_and_buffers_to_ignore: neither broadcast nor reduced.
        self.parameters_to_ignore = set(getattr(module, "_ddp_params_and_buffers_to_ignore", ()))
        ignored = self.parameters_to_ignore
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad and n not in ignored]
        if not named:
            raise RuntimeError(
                "DistributedDataParallel is not needed when a module doesn't have any parameter that requires a gradient."
            )
        options.check_one_device([p for _, p in named])
        self.module = module
        self.process_group = options.process_group_from(process_group, device_mesh)
        self.device = named[0][1].device
        # torch uses these only for a single-device CUDA module: the inputs go to device_ids[0];
        # output_device is kept (torch 2.13 does not move outputs), dim is scatter/gather's.
        self.device_ids, self.output_device = options.device_settings(device_ids, output_device, self.device)
        self.dim = dim
        self.use_side_stream_for_tensor_copies = options.side_stream_copies()
        init_sync_buffers, self.forward_sync_buffers = options.buffer_sync(broadcast_buffers, forward_sync_buffers)
        self.find_unused_parameters = find_unused_parameters
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.batched_grad_copy = batched_grad_copy  # commlab's copies are batched per bucket anyway
        self.static_graph = static_graph
        self.algorithm = algorithm
        self.overlap = overlap
        self.bucket_policy = policy  # commlab/ddp/policy.py; the reducer assigns buckets with it
        self.require_backward_grad_sync = True
        self.require_forward_param_sync = True
        names = [n for n, _ in named]
        params = [p for _, p in named]
        self._module_buffers = [b for n, b in module.named_buffers() if n not in ignored]
        if init_sync:
            # Construction, as torch's: same shapes everywhere, then rank 0's parameters and
            # (unless broadcast_buffers=False) its buffers.
            verify_param_shapes(names, params, self.process_group)
            initial = [p.data for n, p in module.named_parameters() if n not in ignored]
            broadcast_coalesced(initial + (self._module_buffers if init_sync_buffers else []), self.process_group)
        self.comm_groups = options.comm_groups(round_robin_groups, self.process_group)
        if isinstance(round_robin_groups, int) and round_robin_groups > 1:
            # The groups made here stop their workers with it but are not destroyed: torch names a
            # locally synchronised group by its ranks and the number of live groups
            # (distributed_c10d._hash_ranks_to_str), so a group made after a destroy reuses a dead
            # group's name and store keys, and its ranks connect to stale addresses.
            weakref.finalize(self, collectives.release_groups, list(self.comm_groups), destroy=False)
        sparse_ids = sparse_parameters(module)
        dense = [i for i, p in enumerate(params) if id(p) not in sparse_ids]
        self._sparse = sparse_reducer(params, names, dense, self.process_group, algorithm)
        self.sparse_fallback = self._sparse.fallback if self._sparse else None
        self.reducer = Reducer(
            [params[i] for i in dense],
            [names[i] for i in dense],
            group=self.process_group,
            comm_groups=self.comm_groups,
            algorithm=algorithm,
            overlap=overlap,
            find_unused_parameters=find_unused_parameters,
            gradient_as_bucket_view=gradient_as_bucket_view,
            static_graph=static_graph,
            policy=policy,
            device=params[0].device,
        )
        if self._sparse is not None:  # the dense reducer drives the sparse one (sparse.py)
            self.reducer.sparse = self._sparse
            self._sparse.start_backward = _weak_call(self.reducer.on_backward_start)
        self._hook_registered = False
        self._logging = DDPLogging(self)
        if static_graph:
            self._logging.set("static_graph", 1)

    # -- what users and the sweep read ---------------------------------------------------------
    @property
    def bucket_indices(self) -> list[list[int]]:
        """Parameter indices (into the trainable parameters, in module order) of each bucket,
        in reduction order."""
        return [list(b.param_indices) for b in self.reducer.buckets]

    @property
    def bucket_sizes(self) -> list[int]:
        """Bytes of each bucket, in reduction order."""
        return [b.nbytes for b in self.reducer.buckets]

    # torch's attribute (bucket_cap_mb x 1 MiB) and the first bucket's cap: the policy holds both
    bucket_bytes_cap = property(lambda self: self.bucket_policy.cap, doc="The bucket cap in bytes.")
    first_bucket_bytes_cap = property(lambda self: self.bucket_policy.first_cap, doc="The first bucket's cap in bytes.")

    @property
    def iteration_timings(self) -> list[IterationTiming]:
        """One entry per synchronised iteration (definitions in commlab.ddp.timing)."""
        return self.reducer.timings

    def reset_timings(self) -> None:
        self.reducer.reset_timings()

    # -- training ----------------------------------------------------------------------------
    @property
    def broadcast_buffers(self) -> bool:
        """torch's deprecated name for forward_sync_buffers."""
        return self.forward_sync_buffers

    @broadcast_buffers.setter
    def broadcast_buffers(self, value: bool) -> None:
        self.forward_sync_buffers = value

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        grad = torch.is_grad_enabled()
        sync = grad and self.require_backward_grad_sync
        if sync and dist_autograd.in_context():  # before any collective: every rank raises here
            raise NotImplementedError(dist_autograd.MESSAGE)
        joining = self._join_config.enable  # set by ddp.join(), as in torch
        port = self._join_port() if joining else None
        if grad:  # torch's _rebuild_buckets first raises if the last backward left a hole
            self.reducer.usage.check_prior_finished(self.process_group, self._sparse.unfinished if self._sparse else ())
        if joining:
            uneven.notify(port)
        if grad:
            self.reducer.maybe_rebuild()
        if sync:
            self._logging.before_sync_forward(self.reducer)
            self.reducer.start_iteration()
            if self._sparse is not None:
                self._sparse.first_index = len(self.reducer.buckets)
        if self.forward_sync_buffers and self.require_forward_param_sync and self._module_buffers:
            source = uneven.common_rank(port, True) if joining else 0  # rank 0 may have joined
            broadcast_coalesced(self._module_buffers, self.process_group, source)
        if joining:
            uneven.announce_sync(port, sync)
        if self.device_ids and (inputs or kwargs):  # torch's _pre_forward, with torch's helper
            moved, moved_kwargs = _to_kwargs(inputs, kwargs, self.device, self.use_side_stream_for_tensor_copies)
            inputs, kwargs = moved[0], moved_kwargs[0]
        output = self.module(*inputs, **kwargs)
        self.require_forward_param_sync = sync
        if sync:
            usage = self.reducer.usage
            outputs = list(find_tensors(output)) if usage.dynamic else []
            reached = self.reducer.prepare_for_backward(outputs)  # one graph walk for both reducers
            if self._sparse is not None:
                self._sparse.prepare_for_backward(reached)
            if usage.tracking:  # torch's _DDPSink: dynamic search, or the first static iteration
                output = through_sink(output, self.reducer.on_backward_start)
        return output

    # -- uneven inputs (commlab/ddp/join.py) ------------------------------------------------------
    def join(
        self, divide_by_initial_world_size: bool = True, enable: bool = True, throw_on_early_termination: bool = False
    ) -> Join:
        """torch's context manager for ranks with different numbers of batches."""
        self._logging.set("join_uneven_inputs", 1)
        return Join([self], enable, throw_on_early_termination, divide_by_initial_world_size=divide_by_initial_world_size)

    def join_hook(self, **kwargs: Any) -> uneven.DDPJoinHook:
        self._divide_by_initial_world_size = kwargs.get("divide_by_initial_world_size", True)
        return uneven.DDPJoinHook(self._join_port())

    def _join_port(self) -> uneven.JoinPort:
        """All that commlab/ddp/join.py sees of this DDP; its flags are read when it calls."""
        buffers = self._module_buffers  # fixed at construction, as the ignored names are
        return uneven.JoinPort(
            self, self.process_group, self.device, self.reducer, self._divide_by_initial_world_size,
            sync_buffers=lambda: buffers if self.forward_sync_buffers and self.require_forward_param_sync else [],
            final_state=lambda: [p.data for n, p in self.module.named_parameters() if n not in self.parameters_to_ignore]
            + (buffers if self.forward_sync_buffers else []),
            set_forward_param_sync=lambda sync: setattr(self, "require_forward_param_sync", sync))

    @property
    def join_device(self) -> torch.device:
        return self.device

    @property
    def join_process_group(self) -> dist.ProcessGroup:
        return self.process_group

    def train(self, mode: bool = True) -> DistributedDataParallel:
        super().train(mode)
        return self

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward inside accumulates gradients locally; the first one after it synchronises."""
        previous = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = previous

    def register_comm_hook(self, state: object, hook: Callable[[Any, Any], torch.futures.Future]) -> None:
        """Reduce each bucket with ``hook(state, bucket) -> Future[Tensor]`` (torch's signature).

        The hook gets un-divided gradients and must average them itself, as torch's do.
        """
        if self._hook_registered:
            raise RuntimeError("register_comm_hook can only be called once per DistributedDataParallel")
        if not callable(hook):
            raise ValueError(f"hook must be callable, got {type(hook).__name__}")
        self._hook_registered = True
        self._logging.set("comm_hook", getattr(hook, "__qualname__", type(hook).__name__))
        if self._sparse is not None:  # as torch: the hook also gets each sparse bucket, un-divided
            self._sparse.comm_state, self._sparse.comm_hook = state, hook
        self.reducer.comm_state = state
        self.reducer.comm_hook = hook


def _weak_call(method: Callable[[], None]) -> Callable[[], None]:
    ref = weakref.WeakMethod(method)
    return lambda: (ref() or (lambda: None))()
