"""A small model for ``pipeline plan --model tests.support.pipeline_chain:chain`` (not an nn.Sequential)."""

from torch import nn


class Chain(nn.Module):
    """An input projection, ``depth`` residual blocks in a ModuleList, a head."""

    def __init__(self, width: int = 16, depth: int = 4):
        super().__init__()
        self.input_shape = (width,)
        self.proj = nn.Linear(width, width)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(width, 2 * width), nn.ReLU(), nn.Linear(2 * width, width))
                                    for _ in range(depth))  # fmt: skip
        self.head = nn.Linear(width, 4)

    def forward(self, x):
        x = self.proj(x)
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


def chain(**sizes) -> Chain:
    return Chain(**sizes)
