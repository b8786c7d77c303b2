"""The small language model of the tensor-parallel tests, and the same plan for commlab and for torch.

The model has what Megatron splits: a token embedding, blocks of q/k/v/o attention (heads viewed
with -1, so a rank's block of heads runs the same code) and an fc1/fc2 MLP around pre-norm
residuals, a final norm and a head. ``VARIANTS`` names each test configuration: whether the
embedding and head are split by vocabulary, whether sequence parallelism is on, and the head's kind.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

VOCAB, D_MODEL, HEADS, LAYERS, SEQ, BATCH = 32, 16, 4, 2, 8, 2

# name -> (vocab-parallel embedding, sequence parallel, head kind: None whole, "colwise" with the
# vocab-parallel loss, "colwise_gather" with the ordinary loss)
VARIANTS = {
    "plain": (False, False, None),
    "vocab": (True, False, "colwise"),
    "sp": (False, True, None),
    "sp_vocab": (True, True, "colwise"),
    "sp_gather_head": (True, True, "colwise_gather"),
}


class Attention(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads, self.head_dim = heads, d // heads
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.q(x), self.k(x), self.v(x)
        b, t = q.shape[:2]  # not x's: with sequence parallelism x is a block of the sequence, q is whole
        q, k, v = (z.view(b, t, -1, self.head_dim).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) * self.head_dim ** -0.5
        causal = torch.ones(t, t, dtype=torch.bool).tril()
        y = att.masked_fill(~causal, float("-inf")).softmax(-1) @ v
        return self.o(y.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class Block(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.ln1, self.attn, self.ln2, self.mlp = nn.LayerNorm(d), Attention(d, heads), nn.LayerNorm(d), MLP(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class SmallLM(nn.Module):
    def __init__(self, vocab: int = VOCAB, d: int = D_MODEL, heads: int = HEADS, layers: int = LAYERS):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.head(self.norm(h))


def batch(step: int, replica: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The same tokens on every rank of a tensor-parallel group (they split the model, not the
    data); another data-parallel replica gets other tokens."""
    g = torch.Generator().manual_seed(100 + step + 1000 * replica)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    return tokens, torch.roll(tokens, -1, dims=1)


def commlab_plan(vocab: bool, head: str | None) -> dict[str, str]:
    plan = {"layers.*.attn.[qkv]": "colwise", "layers.*.attn.o": "rowwise", "layers.*.mlp.fc1": "colwise",
            "layers.*.mlp.fc2": "rowwise", "layers.*.ln[12]": "sequence", "norm": "sequence",
            "layers.0": "split_sequence", "head": head or "gather_sequence"}
    if vocab:
        plan["tok"] = "vocab"
    return plan


def torch_plan(vocab: bool, sp: bool, head: str | None) -> dict:
    """The same split in torch's styles; with sequence parallelism, torch's own recipe (its TP tutorial's)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, PrepareModuleOutput,
                                                   RowwiseParallel, SequenceParallel)

    gather_seq = lambda: PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),  # noqa: E731
                                            use_local_output=True)
    plan = {}
    for i in range(LAYERS):
        for name in "qkv":
            plan[f"layers.{i}.attn.{name}"] = ColwiseParallel()
        plan[f"layers.{i}.mlp.fc1"] = ColwiseParallel()
        for name in ("attn.o", "mlp.fc2"):
            plan[f"layers.{i}.{name}"] = RowwiseParallel(output_layouts=Shard(1)) if sp else RowwiseParallel()
        if sp:
            plan[f"layers.{i}.ln1"] = plan[f"layers.{i}.ln2"] = SequenceParallel()
            plan[f"layers.{i}.attn"], plan[f"layers.{i}.mlp"] = gather_seq(), gather_seq()
    if sp:
        plan["norm"] = SequenceParallel()
    if vocab:
        plan["tok"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1) if sp else Replicate())
    elif sp:
        plan["tok"] = PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Shard(1))
    into_head = Shard(1) if sp else Replicate()
    if head == "colwise":
        plan["head"] = ColwiseParallel(input_layouts=into_head, use_local_output=False)
    elif head == "colwise_gather":
        plan["head"] = ColwiseParallel(input_layouts=into_head, output_layouts=Replicate())
    elif sp:
        plan["head"] = gather_seq()
    return plan
