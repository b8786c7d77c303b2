"""torch DDP's private methods that tools and torch's own tests call, its legacy helpers, and pickling as torch's.

A mixin of commlab.DistributedDataParallel (commlab/ddp/distributed.py), kept apart so that the
DDP's own file stays about its training path. The logging dictionary is commlab/ddp/logging_data.py.
Pickling follows torch's DistributedDataParallel.__getstate__/__setstate__: the process group and
the reducer are dropped, and a load rebuilds them on the default group of the loading process,
without the construction's collectives (no shape check, no broadcast), so one rank may load alone.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.utils import _to_kwargs
from torch.nn.parallel import DistributedDataParallel as TorchDDP
from torch.nn.parallel.scatter_gather import gather, scatter_kwargs


class TorchPrivateAPI:
    """``_get_ddp_logging_data``, ``_set_ddp_runtime_logging_sample_rate``, ``_set_static_graph``,
    ``_log_and_throw``, the parameters-to-ignore helpers, ``scatter`` / ``to_kwargs`` / ``gather``,
    and ``__getstate__`` / ``__setstate__``
    (so pickle, torch.save and copy.deepcopy work as torch's do)."""

    # torch's static helpers for parameters DDP leaves alone (commlab reads the same attribute,
    # ``_ddp_params_and_buffers_to_ignore``), taken from torch rather than rewritten.
    _set_params_and_buffers_to_ignore_for_model = staticmethod(TorchDDP._set_params_and_buffers_to_ignore_for_model)
    _get_data_parallel_params = staticmethod(TorchDDP._get_data_parallel_params)

    # torch's scatter / to_kwargs / gather helpers (kept by torch for backward compatibility).
    def scatter(self, inputs: Any, kwargs: Any, device_ids: Sequence[int]) -> Any:
        return scatter_kwargs(inputs, kwargs, device_ids, dim=self.dim)

    def to_kwargs(self, inputs: Any, kwargs: Any, device_id: int) -> Any:
        return _to_kwargs(inputs, kwargs, torch.device(self.device.type, device_id), self.use_side_stream_for_tensor_copies)

    def gather(self, outputs: Any, output_device: int | torch.device) -> Any:
        return gather(outputs, output_device, dim=self.dim)

    def _get_ddp_logging_data(self) -> dict[str, Any]:
        """torch's logging dictionary (keys and meanings in commlab/ddp/logging_data.py)."""
        return dict(self._logging.data)

    def _set_ddp_runtime_logging_sample_rate(self, sample_rate: int) -> None:
        """Runtime stats are taken for the first 10 iterations, then every ``sample_rate``-th."""
        if sample_rate < 1:
            self._log_and_throw(ValueError, "DDP runtime logging sample rate should be equal or greater than 1")
        self._logging.sample_rate = sample_rate

    def _set_static_graph(self) -> None:
        """torch's deprecated spelling of ``static_graph=True``, before the first iteration."""
        if self.static_graph:
            warnings.warn("You've set static_graph to be True, no need to set it again.", stacklevel=2)
            return
        if self._logging.iterations > 0:  # torch's REDUCER_CHECK in Reducer::set_static_graph
            self._log_and_throw(
                RuntimeError,
                "set_static_graph() should be called before training loop starts and after "
                "DistributedDataParallel is constructed.",
            )
        self.static_graph = True
        self.reducer.set_static_graph(self.find_unused_parameters)
        self._logging.set("static_graph", 1)
        if self.find_unused_parameters:
            warnings.warn(
                "You passed find_unused_parameters=true to DistributedDataParallel, `_set_static_graph` "
                "will detect unused parameters automatically, so you do not need to set "
                "find_unused_parameters=true, just be sure these unused parameters will not change "
                "during training loop while calling `_set_static_graph`.",
                stacklevel=2,
            )

    def _log_and_throw(self, err_type: type[Exception], err_msg: str) -> None:
        self._logging.error(err_msg)
        raise err_type(err_msg)

    def __getstate__(self) -> dict[str, Any]:
        """The module and the settings, without the process group and the reducer, as torch's
        DDP.__getstate__: so only a DDP on the default group (and its own groups) can be pickled."""
        if self.process_group is not dist.group.WORLD or self._settings["round_robin_groups"] != 1:
            raise RuntimeError(
                "DDP Pickling/Unpickling are only supported when using DDP with the default process "
                "group. That is, when you have called init_process_group and have not passed "
                "process_group argument to DDP constructor (nor round_robin_groups)"
            )
        settings = dict(self._settings, static_graph=self.static_graph, forward_sync_buffers=self.forward_sync_buffers)
        return {"module": self.module, "settings": settings, "training": self.training,
                "require_backward_grad_sync": self.require_backward_grad_sync}  # fmt: skip

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Rebuild on the default group of this process, without the construction's collectives
        (torch's __setstate__ neither re-checks shapes nor broadcasts): a rank may load alone."""
        settings = dict(state["settings"], init_sync=False)
        self.__init__(state["module"], **settings)
        self._settings["init_sync"] = state["settings"]["init_sync"]
        self.train(state["training"])
        self.require_backward_grad_sync = state["require_backward_grad_sync"]
