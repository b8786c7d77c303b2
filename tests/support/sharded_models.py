"""Small models of the sharded tests: odd parameter counts, a root-held parameter, a tied weight,
batch-norm buffers, an unused layer."""

from __future__ import annotations

import torch
from torch import nn


class Net(nn.Module):
    """134 parameters (63 + 50 + 18 + 3): the total does not divide by 3, and at world size 2 the
    buckets by unit and by a 200-byte cap (3 and 63 elements) do not divide by 2; ``scale`` is
    held by the root itself, as fully_shard's root keeps its own."""

    def __init__(self, frozen: bool = False):
        super().__init__()
        self.a, self.b, self.head = nn.Linear(6, 9), nn.Linear(9, 5), nn.Linear(5, 3)
        self.scale = nn.Parameter(torch.ones(3))  # held by the root itself
        if frozen:
            self.b.bias.requires_grad_(False)

    def forward(self, x):
        return self.head(torch.tanh(self.b(torch.relu(self.a(x))))) * self.scale


class TiedNet(nn.Module):
    """One weight used by two modules (``b.weight`` is ``a.weight``): one parameter, two holders."""

    def __init__(self, frozen: bool = False):
        super().__init__()
        self.a, self.b, self.head = nn.Linear(6, 6), nn.Linear(6, 6), nn.Linear(6, 3)
        self.b.weight = self.a.weight

    def forward(self, x):
        return self.head(torch.relu(self.b(torch.relu(self.a(x)))))


def bn_net(frozen: bool = False) -> nn.Module:
    """Buffers (batch-norm statistics), which stay each rank's own, as with torch DDP's
    ``broadcast_buffers=False``."""
    return nn.Sequential(nn.Linear(6, 7), nn.BatchNorm1d(7), nn.ReLU(), nn.Linear(7, 3))


class WithUnused(Net):
    """``unused`` gets no gradient on any rank: it keeps none, the rest trains."""

    def __init__(self):
        super().__init__()
        self.unused = nn.Linear(3, 3)


MODELS = {"net": Net, "tied": TiedNet, "bn": bn_net}
