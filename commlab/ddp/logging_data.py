"""torch's DDP logging data (``_get_ddp_logging_data``): torch's keys, filled from commlab's stamps.

torch's C++ Logger (torch/csrc/distributed/c10d/logger.cpp) keeps one dictionary per DDP: the
construction facts (sizes, dtypes, settings, the environment a bug report needs) and, at sampled
iterations, the runtime stats of the iteration before. The same here, with the same meanings:

- sampling: at the start of synchronised forward ``n + 1`` the stats of iteration ``n`` are
  taken if ``n <= 10`` or ``n`` is a multiple of the sample rate (default 100,
  ``_set_ddp_runtime_logging_sample_rate``); ``iteration`` is then ``n``;
- times are integer nanoseconds: ``forward_compute_time`` (forward start -> end of forward),
  ``backward_compute_time`` (end of forward -> end of backward compute), ``backward_comm_time``
  (the first bucket handed to its all-reduce -> gradients written back),
  ``backward_compute_comm_overlap_time`` (first bucket handed over -> end of backward compute,
  0 if it was handed over later); ``avg_*`` are their means over the sampled iterations; the
  ``*_start`` / ``*_end`` keys are those moments in nanoseconds since the epoch (CPU modules
  only: on CUDA the stamps are device events, which have no host time);
- ``bucket_sizes`` (bytes, in reduction order) at construction; ``rebuilt_bucket_sizes`` and
  ``rebuilt_per_bucket_param_indices`` (buckets joined by ", ", indices by " ") once the buckets
  were rebuilt; ``prev_iteration_grad_ready_order_indices`` the order of the gradient hooks.

commlab's own timing breakdown (``DistributedDataParallel.iteration_timings``) is finer; this
dictionary is for tools written against torch's.
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

DEFAULT_SAMPLE_RATE = 100  # torch's kDDPRuntimeLoggingSampleRate
_DTYPE_NAMES = {torch.float32: "float", torch.float64: "double", torch.float16: "c10::Half", torch.bfloat16: "c10::BFloat16"}
_ENV = {
    "master_port": "MASTER_PORT", "master_addr": "MASTER_ADDR", "torch_distributed_debug": "TORCH_DISTRIBUTED_DEBUG",
    "cuda_visible_devices": "CUDA_VISIBLE_DEVICES",
}  # fmt: skip
_GLOO_ENV = {"gloo_socket_ifname": "GLOO_SOCKET_IFNAME", "gloo_device_transport": "GLOO_DEVICE_TRANSPORT"}
_NCCL_ENV = {
    "nccl_socket_ifname": "NCCL_SOCKET_IFNAME", "nccl_blocking_wait": "TORCH_NCCL_BLOCKING_WAIT",
    "nccl_async_error_handling": "TORCH_NCCL_ASYNC_ERROR_HANDLING", "nccl_debug": "NCCL_DEBUG",
    "nccl_nthreads": "NCCL_NTHREADS", "nccl_ib_timeout": "NCCL_IB_TIMEOUT",
}  # fmt: skip


def should_collect(iteration: int, sample_rate: int) -> bool:
    """torch's Reducer::should_collect_runtime_stats for ``iteration`` synchronised forwards."""
    return iteration > 0 and (iteration <= 10 or iteration % sample_rate == 0)


def dtype_name(dtype: torch.dtype) -> str:
    """The name torch's logger gives a dtype (caffe2::TypeMeta::name)."""
    return _DTYPE_NAMES.get(dtype, str(dtype).removeprefix("torch."))


def join_sizes(sizes: list[int]) -> str:
    return ", ".join(str(s) for s in sizes)


def construction_data(ddp: Any) -> dict[str, Any]:
    """The keys torch's Logger::set_construction_data_and_log sets, for ``ddp``."""
    params = ddp.reducer.params
    backend = dist.get_backend(ddp.process_group)
    data: dict[str, Any] = {
        "world_size": dist.get_world_size(ddp.process_group),
        "rank": dist.get_rank(ddp.process_group),
        "module_name": type(ddp.module).__name__,
        "device_ids": ", ".join(str(i) for i in ddp.device_ids or []),
        "output_device": -1 if ddp.output_device is None else int(ddp.output_device),
        "broadcast_buffers": int(ddp.forward_sync_buffers),
        "has_sync_bn": int(any(isinstance(m, nn.SyncBatchNorm) for m in ddp.module.modules())),
        "bucket_cap_bytes": int(ddp.bucket_bytes_cap),
        "find_unused_parameters": int(ddp.find_unused_parameters),
        "gradient_as_bucket_view": int(ddp.gradient_as_bucket_view),
        "backend_name": backend,
        "iteration": 0,
        "dtypes": ", ".join(sorted({dtype_name(p.dtype) for p in params})),
        "total_parameter_size_bytes": sum(p.numel() * p.element_size() for p in params),
        "num_parameter_tensors": len(params),
        "bucket_sizes": join_sizes(ddp.bucket_sizes),
        "is_multi_device_module": 0,
    }
    data.update({key: os.environ.get(var, "N/A") for key, var in _ENV.items()})
    if backend == "gloo":
        data.update({key: os.environ.get(var, "N/A") for key, var in _GLOO_ENV.items()})
        data["gloo_num_threads"] = 2  # ProcessGroupGloo's default, which torch's logger reports
    elif backend == "nccl":
        data.update({key: os.environ.get(var, "N/A") for key, var in _NCCL_ENV.items()})
    return data


class DDPLogging:
    """One DDP's dictionary and its sampling state (torch's Logger)."""

    def __init__(self, ddp: Any):
        self.data = construction_data(ddp)
        self.sample_rate = DEFAULT_SAMPLE_RATE
        self.iterations = 0  # synchronised forwards so far (torch's num_iterations_)
        self._recorded = 0  # sampled iterations (torch's num_iterations_stats_recorded_)
        self._rebuilds = ddp.reducer.rebuild_pending  # whether the buckets will be rebuilt once
        self._epoch_ns = time.time_ns() - time.perf_counter_ns()  # CPU stamps -> epoch nanoseconds

    def set(self, key: str, value: Any) -> None:
        self.data[key] = value

    def error(self, message: str) -> None:
        """torch's _log_and_throw records the error before raising it."""
        self.data["has_error"] = 1
        self.data["error"] = message

    def before_sync_forward(self, reducer: Any) -> None:
        """At the start of a synchronised forward: sample the previous iteration, count this one."""
        if should_collect(self.iterations, self.sample_rate):
            self._sample(reducer)
        self.iterations += 1
        reducer.grad_order = [] if should_collect(self.iterations, self.sample_rate) else None

    def _sample(self, reducer: Any) -> None:
        raw = getattr(reducer, "last_iteration", None)
        if raw is None:  # that iteration's backward never completed
            return
        self._recorded += 1
        d = self.data
        d["iteration"] = self.iterations
        d["num_buckets_reduced"] = len(raw.buckets)
        d["unused_parameter_size"] = sum(reducer.params[i].numel() * reducer.params[i].element_size() for i in reducer._unused)
        if self._rebuilds and not reducer.rebuild_pending and not d.get("has_rebuilt_buckets"):
            d["has_rebuilt_buckets"] = 1
            d["rebuilt_bucket_sizes"] = join_sizes([b.nbytes for b in reducer.buckets])
            d["rebuilt_per_bucket_param_indices"] = ", ".join(" ".join(map(str, b.param_indices)) for b in reducer.buckets)
        elif "has_rebuilt_buckets" not in d:
            d["has_rebuilt_buckets"] = 0
        if reducer.grad_order:
            d["prev_iteration_grad_ready_order_indices"] = ", ".join(map(str, reducer.grad_order))
        clock = reducer.clock
        # The first launch: stamps are floats on CPU but CUDA events on GPU, so order by elapsed time.
        comm_start = min((b[5] for b in raw.buckets), key=lambda s: clock.seconds(raw.start, s), default=raw.end)
        compute_end = raw.backward_end if raw.backward_end is not None else raw.end
        ns = lambda a, b: max(0, int(round(clock.seconds(a, b) * 1e9)))  # noqa: E731
        times = {
            "forward_compute_time": ns(raw.start, raw.forward_end),
            "backward_compute_time": ns(raw.forward_end, compute_end),
            "backward_comm_time": ns(comm_start, raw.end),
            "backward_compute_comm_overlap_time": ns(comm_start, compute_end),
        }
        for key, value in times.items():
            d[key] = value
            mean = d.get(f"avg_{key}", 0)
            d[f"avg_{key}"] = int((mean * (self._recorded - 1) + value) / self._recorded)
        if isinstance(raw.start, float):  # CPU stamps: host times
            host = lambda stamp: int(stamp * 1e9) + self._epoch_ns  # noqa: E731
            d["forward_compute_time_start"] = host(raw.start)
            d["backward_compute_time_start"] = host(raw.forward_end)
            d["backward_compute_time_end"] = host(compute_end)
            d["backward_comm_time_start"] = host(comm_start)
            d["backward_comm_time_end"] = host(raw.end)
