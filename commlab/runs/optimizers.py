"""The optimizers a run trains with: their names, the state they keep, and how torch builds them.

    parse_optimizer("Adam")              -> "adam"
    state_bytes("adam")                  -> 8.0: fp32 exp_avg and exp_avg_sq per parameter
    build_optimizer("adam", params)      -> torch.optim.Adam(params, lr=1e-4)

One registry for every reader of a name: the sweep's ``--optimizer`` axis and its worker, the
calibration that profiles the optimizer's step, and the ZeRO memory model's K. The state is what
sharding saves at stage 1: plain SGD keeps none, so with it stages 1-2 have nothing to shard but
gradients. Torch-free at import; :func:`build_optimizer` imports torch when called.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

# The learning rate of every measured step: small, so that a long sweep stays numerically tame.
LR = 1e-4


@dataclass(frozen=True)
class OptimizerKind:
    """One registered optimizer: its torch class and its state bytes per fp32 parameter."""

    name: str
    torch_class: str  # an attribute of torch.optim
    state_bytes: float  # K of the ZeRO memory model (commlab/sharded/memory_model.py) in fp32
    about: str
    options: tuple[tuple[str, Any], ...] = ()  # keyword arguments beyond the learning rate


OPTIMIZERS: dict[str, OptimizerKind] = {o.name: o for o in (
    OptimizerKind("sgd", "SGD", 0.0, "plain SGD, no state (torch/optim/sgd.py without momentum)"),
    OptimizerKind("momentum", "SGD", 4.0, "SGD with momentum 0.9: one momentum buffer (torch/optim/sgd.py)",
                  (("momentum", 0.9),)),
    OptimizerKind("adam", "Adam", 8.0, "Adam: exp_avg and exp_avg_sq, 4 bytes each (torch/optim/adam.py)"),
    OptimizerKind("adamw", "AdamW", 8.0, "AdamW: Adam's two moments (torch/optim/adamw.py)"),
)}
DEFAULT = "sgd"  # what every run made before the optimizer was an option trained with


def parse_optimizer(value: Any) -> str:
    """A registered name (any case, surrounding blanks ignored); ValueError naming them otherwise."""
    name = str(value).strip().lower()
    if name not in OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {', '.join(OPTIMIZERS)}, got {value!r}")
    return name


def state_bytes(name: str) -> float:
    """Optimizer state bytes per parameter (fp32) of a registered optimizer."""
    return OPTIMIZERS[parse_optimizer(name)].state_bytes


def build_optimizer(name: str, params: Iterable[Any]):
    """The torch optimizer ``name`` over ``params``, with the shared learning rate."""
    import torch  # lazy: the run vocabulary stays torch-free

    kind = OPTIMIZERS[parse_optimizer(name)]
    return getattr(torch.optim, kind.torch_class)(params, lr=LR, **dict(kind.options))
