"""The full optimizer state dict: the optimizer's own ``state_dict()`` with every DTensor (the
shards' state: Adam's moments, SGD's momentum buffer) gathered whole, loadable into the same
optimizer built over the unsharded module.

torch's ``Optimizer.state_dict`` already numbers the parameters (in the order of its groups) and
keeps the groups and their hyper-parameters; the parameters are the module's own, in its own
shapes (commlab/sharded/dparams.py), so only the values need gathering: ``full_tensor()`` of each
DTensor, in index order, the same on every rank (a collective: every rank calls it). Other state
(Adam's scalar ``step``, the state of frozen, replicated parameters) is the same on every rank
and copied.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor


def full_optimizer_state_dict(optimizer: torch.optim.Optimizer) -> dict:
    sd = optimizer.state_dict()
    state = {}
    for index in sorted(sd["state"]):
        state[index] = {
            key: (value.full_tensor() if isinstance(value, DTensor) else
                  value.clone() if isinstance(value, torch.Tensor) else value)
            for key, value in sorted(sd["state"][index].items())
        }
    return {"state": state, "param_groups": sd["param_groups"]}
