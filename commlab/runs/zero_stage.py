"""A ZeRO stage as what it shards, parsed in one place (torch-free).

    parse_stage("2")      -> ZeroStage(stage=2): optimizer state and gradients sharded
    parse_stage(0).ddp    -> True: nothing sharded, commlab.DistributedDataParallel

Stage 0 is replicated data parallelism (DDP); 1 shards the optimizer state, 2 also the
gradients, 3 also the parameters (Rajbhandari et al. 2020). Every reader of a stage goes through
:func:`parse_stage`: the sweep's ``--stage``, the tuner's (whose ``auto``, every stage, is its
own choice beside these), ShardedDataParallel's ``stage=`` (which refuses 0: that is
DistributedDataParallel), the sharded lowering and the ZeRO memory model.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import Any

STAGES = (0, 1, 2, 3)


@dataclass(frozen=True)
class ZeroStage:
    """One stage; build it with :func:`parse_stage` (the constructor checks the same way)."""

    stage: int

    def __post_init__(self) -> None:
        if isinstance(self.stage, bool) or not isinstance(self.stage, int) or self.stage not in STAGES:
            raise ValueError(_not_a_stage(self.stage))

    @property
    def ddp(self) -> bool:
        """Nothing sharded: replicated data parallelism, commlab's DistributedDataParallel."""
        return self.stage == 0

    @property
    def optimizer_state(self) -> bool:
        """Each rank keeps the optimizer state of its shard only."""
        return self.stage >= 1

    @property
    def gradients(self) -> bool:
        """Each rank keeps its shard's reduced gradients only (a reduce-scatter, not an all-reduce)."""
        return self.stage >= 2

    @property
    def parameters(self) -> bool:
        """Each rank keeps its shard of the parameters, gathered around their use."""
        return self.stage >= 3

    @property
    def wrapper(self) -> str:
        """The commlab class that trains at this stage."""
        return "DistributedDataParallel" if self.ddp else "ShardedDataParallel"


def parse_stage(value: Any) -> ZeroStage:
    """``0``-``3`` (an integer, or its text as an option gives it) -> its :class:`ZeroStage`;
    anything else (``True``, ``1.5``, ``"4"``) -> ValueError with the one message."""
    if isinstance(value, str):
        text = value.strip()
        number = int(text) if text in {str(s) for s in STAGES} else None
    elif isinstance(value, bool):
        number = None
    else:
        # 2.0 == 2 was a stage before there was one parser: keep it one
        number = int(value) if isinstance(value, numbers.Real) and value in STAGES else None
    if number is None:
        raise ValueError(_not_a_stage(value))
    return ZeroStage(number)


def _not_a_stage(value: Any) -> str:
    return (f"stage must be 0 (DDP: nothing sharded), 1 (optimizer state sharded), 2 (and gradients) "
            f"or 3 (and parameters), got {value!r}")
