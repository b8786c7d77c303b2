"""Model families the predictor was never developed on, as ``package.module:factory`` models.

    commlab predict --model examples.heldout_models:convnet --model-args channels=64 ...

(run from the repository root, or with it on PYTHONPATH). The predictor was calibrated and
tuned on the built-in MLP only; these are its held-out workloads (commlab/validation/ddp.py).
The pipeline planner's held-out check (``commlab pipeline plan --model ... --validate``) runs
``mixer``, written for it and first run with the planner's method fixed (docs/measurements.md); the DDP
predictor's ``--part head`` runs ``wide_head``, written for a gradient over glibc's mmap threshold.
Each factory returns an nn.Module with an ``input_shape`` attribute (commlab/models.py).
"""

from __future__ import annotations

from torch import nn


class ConvNet(nn.Module):
    """Three 3x3 conv blocks (channels, 2x, 4x; stride-2 pooling) and a wide two-layer head.

    The head holds most of the bytes (gradients ready first in backward), the convolutions most
    of the compute (ready last): the opposite of an MLP's even spread, which is the point.
    """

    def __init__(self, channels: int = 32, side: int = 16, hidden: int = 2048, classes: int = 10):
        super().__init__()
        self.input_shape = (3, side, side)
        c = channels
        self.features = nn.Sequential(
            nn.Conv2d(3, c, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(c, 2 * c, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(2 * c, 4 * c, 3, padding=1), nn.ReLU(),
        )
        flat = 4 * c * (side // 4) ** 2
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(flat, hidden), nn.ReLU(), nn.Linear(hidden, classes))

    def forward(self, x):
        return self.head(self.features(x))


def convnet(channels: int = 32, side: int = 16, hidden: int = 2048) -> ConvNet:
    return ConvNet(channels, side, hidden)


class Block(nn.Module):
    """Pre-norm transformer blocks on a float sequence (no embedding): attention and MLP."""

    def __init__(self, d_model: int = 256, layers: int = 2, heads: int = 4, seq: int = 32):
        super().__init__()
        self.input_shape = (seq, d_model)
        layer = nn.TransformerEncoderLayer(d_model, heads, 4 * d_model, dropout=0.0, batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)

    def forward(self, x):
        return self.blocks(x)


def blocks(d_model: int = 256, layers: int = 2, heads: int = 4, seq: int = 32) -> Block:
    return Block(d_model, layers, heads, seq)


class MixerBlock(nn.Module):
    """An MLP-Mixer block (Tolstikhin et al., 2021): an MLP across tokens, then one across channels."""

    def __init__(self, tokens: int, channels: int, token_hidden: int, channel_hidden: int):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(channels), nn.LayerNorm(channels)
        self.tokens = nn.Sequential(nn.Linear(tokens, token_hidden), nn.GELU(), nn.Linear(token_hidden, tokens))
        self.channels = nn.Sequential(nn.Linear(channels, channel_hidden), nn.GELU(), nn.Linear(channel_hidden, channels))

    def forward(self, x):
        x = x + self.tokens(self.norm1(x).transpose(1, 2)).transpose(1, 2)
        return x + self.channels(self.norm2(x))


class Mixer(nn.Module):
    """Patch embedding, ``depth`` Mixer blocks in a ModuleList, a norm, mean over tokens, a head."""

    def __init__(self, tokens: int = 64, patch: int = 48, channels: int = 96, depth: int = 6, token_hidden: int = 128,
                 channel_hidden: int = 384, classes: int = 10):  # fmt: skip
        super().__init__()
        self.input_shape = (tokens, patch)
        self.embed = nn.Linear(patch, channels)
        self.blocks = nn.ModuleList(MixerBlock(tokens, channels, token_hidden, channel_hidden) for _ in range(depth))
        self.norm = nn.LayerNorm(channels)
        self.head = nn.Linear(channels, classes)

    def forward(self, x):
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x).mean(dim=1))


def mixer(tokens: int = 64, patch: int = 48, channels: int = 96, depth: int = 6, token_hidden: int = 128,
          channel_hidden: int = 384) -> Mixer:  # fmt: skip
    return Mixer(tokens, patch, channels, depth, token_hidden, channel_hidden)


class WideHead(nn.Module):
    """A small MLP trunk and one vocabulary-sized output projection, as a language model's head.

    At the default sizes the head's weight (7000 x 1280 fp32, 34.2 MiB) is over glibc's 32 MiB
    mmap threshold (commlab/_malloc.py) and over half of a 64 MiB bucket: its gradient is fresh
    pages every step, the trunk's 6.25 MiB ones never. It is ready first in backward, so with
    buckets of 1-32 MiB it rides alone, and one 64 MiB bucket holds the whole 61.7 MiB model.
    """

    def __init__(self, features: int = 512, width: int = 1280, depth: int = 5, vocab: int = 7000):
        super().__init__()
        self.input_shape = (features,)
        layers: list[nn.Module] = [nn.Linear(features, width), nn.ReLU()]
        for _ in range(depth - 1):
            layers += [nn.Linear(width, width), nn.ReLU()]
        self.trunk = nn.Sequential(*layers)
        self.head = nn.Linear(width, vocab)

    def forward(self, x):
        return self.head(self.trunk(x))


def wide_head(features: int = 512, width: int = 1280, depth: int = 5, vocab: int = 7000) -> WideHead:
    return WideHead(features, width, depth, vocab)


class WideAttention(nn.Module):
    """Self-attention with separate query/key/value layers whose heads are viewed with -1, so a
    tensor-parallel plan that splits them by columns runs the same code on a rank's heads."""

    def __init__(self, d_model: int, heads: int):
        super().__init__()
        self.head_dim = d_model // heads
        self.query, self.key, self.value = (nn.Linear(d_model, d_model) for _ in range(3))
        self.mix = nn.Linear(d_model, d_model)

    def forward(self, x):
        b, t = x.shape[:2]
        q, k, v = (f(x).view(b, t, -1, self.head_dim).transpose(1, 2) for f in (self.query, self.key, self.value))
        y = nn.functional.scaled_dot_product_attention(q, k, v)
        return self.mix(y.transpose(1, 2).reshape(b, t, -1))


class WideBlock(nn.Module):
    """A post-norm block (unlike the GPT's pre-norm) with a ``ratio``-times-wide SiLU MLP."""

    def __init__(self, d_model: int, heads: int, ratio: int):
        super().__init__()
        self.attn = WideAttention(d_model, heads)
        self.up, self.down = nn.Linear(d_model, ratio * d_model), nn.Linear(ratio * d_model, d_model)
        self.norm1, self.norm2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)

    def forward(self, x):
        x = self.norm1(x + self.attn(x))
        return self.norm2(x + self.down(nn.functional.silu(self.up(x))))


class WideLM(nn.Module):
    """A float-sequence transformer for the layout planner's held-out check: an input projection,
    ``depth`` post-norm blocks of ``heads`` non-causal heads and a ``ratio``-wide MLP, a head.
    Its tensor-parallel plan is :data:`WIDE_LM_PLAN` (``wide_lm_plan``)."""

    def __init__(self, d_model: int = 192, heads: int = 6, depth: int = 4, seq: int = 48, ratio: int = 6,
                 features: int = 32):  # fmt: skip
        super().__init__()
        if d_model % heads:
            raise ValueError(f"d_model {d_model} is not a multiple of heads {heads}")
        self.input_shape, self.heads = (seq, features), heads
        self.embed = nn.Linear(features, d_model)
        self.blocks = nn.ModuleList(WideBlock(d_model, heads, ratio) for _ in range(depth))
        self.head = nn.Linear(d_model, features)

    def forward(self, x):
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def wide_lm(d_model: int = 192, heads: int = 6, depth: int = 4, seq: int = 48, ratio: int = 6) -> WideLM:
    return WideLM(d_model, heads, depth, seq, ratio)


# Megatron's split of each block: query/key/value and the MLP's first layer by columns, the
# attention's output and the MLP's second layer by rows; the input projection and head whole.
WIDE_LM_PLAN = {"blocks.*.attn.query": "colwise", "blocks.*.attn.key": "colwise", "blocks.*.attn.value": "colwise",
                "blocks.*.attn.mix": "rowwise", "blocks.*.up": "colwise", "blocks.*.down": "rowwise"}


def wide_lm_plan() -> dict[str, str]:
    return dict(WIDE_LM_PLAN)
