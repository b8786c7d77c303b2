"""Workloads: built-in models, optional model-zoo models, user factories, and synthetic batches.

Built-in models need nothing beyond torch. ``resnet50`` (torchvision) and ``bert``
(transformers, random weights from a config: nothing is downloaded) need the ``models`` extra.
Any other model is named as ``package.module:factory``; the factory takes the sizes as keyword
arguments (none by default) and returns an ``nn.Module`` whose input is a float tensor of shape
``(batch, *input_shape)`` given by an ``input_shape`` attribute on the module (default:
``(in_features,)`` of its first Linear). The module is imported as ``python -m`` would import
it: from the current directory first, then ``sys.path`` (in the ranks too, which start in the
launcher's directory), so ``examples.heldout_models:convnet`` works from the repository root.
"""

from __future__ import annotations

import importlib
import inspect
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

import torch
from torch import nn

BUILTIN = ("mlp", "transformer", "gpt")
OPTIONAL = {"resnet50": "torchvision", "bert": "transformers"}


@dataclass(frozen=True)
class Workload:
    """A model together with how to make a synthetic batch and a loss for it."""

    model: nn.Module
    make_batch: Callable[[int, torch.Generator], tuple[torch.Tensor, torch.Tensor]]
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def mlp(depth: int = 12, width: int = 1024, in_features: int | None = None, classes: int = 10) -> nn.Sequential:
    """``depth`` Linear+ReLU blocks of ``width`` features, then a classifier: an nn.Sequential."""
    if depth < 1 or width < 1:
        raise ValueError(f"mlp needs depth >= 1 and width >= 1, got depth={depth}, width={width}")
    layers: list[nn.Module] = []
    fan_in = in_features or width
    for _ in range(depth):
        layers += [nn.Linear(fan_in, width), nn.ReLU()]
        fan_in = width
    layers.append(nn.Linear(width, classes))
    return nn.Sequential(*layers)


class TinyTransformer(nn.Module):
    """A small encoder-only transformer language model (token embedding, N layers, LM head)."""

    def __init__(self, vocab: int = 1024, d_model: int = 256, layers: int = 4, heads: int = 4, seq: int = 64):
        super().__init__()
        self.seq = seq
        self.vocab = vocab
        self.embed = nn.Embedding(vocab, d_model)
        self.pos = nn.Parameter(torch.zeros(seq, d_model))
        block = nn.TransformerEncoderLayer(d_model, heads, 4 * d_model, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d_model, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.embed(tokens) + self.pos[: tokens.shape[1]]))


class Block(nn.Module):
    """A pre-norm transformer block: causal self-attention, then an MLP, each around a residual.

    q, k and v are separate layers and the heads are viewed with -1, so that a tensor-parallel
    plan (``commlab.tensor.gpt_plan``) splits them by columns and the same code runs on a rank's
    block of heads; the sequence length is read from q, which is whole even where the residual
    stream is a block of the sequence (sequence parallelism)."""

    def __init__(self, d_model: int, heads: int):
        super().__init__()
        if d_model % heads:
            raise ValueError(f"d_model {d_model} is not a multiple of heads {heads}")
        self.heads, self.head_dim = heads, d_model // heads
        self.ln1 = nn.LayerNorm(d_model)
        self.q, self.k, self.v = (nn.Linear(d_model, d_model) for _ in range(3))
        self.proj = nn.Linear(d_model, d_model)
        self.ln2 = nn.LayerNorm(d_model)
        self.fc = nn.Linear(d_model, 4 * d_model)
        self.out = nn.Linear(4 * d_model, d_model)

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        h = self.ln1(x)
        q, k, v = self.q(h), self.k(h), self.v(h)
        b, t = q.shape[:2]
        q, k, v = (z.view(b, t, -1, self.head_dim).transpose(1, 2) for z in (q, k, v))
        allowed = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        if attention_mask is not None:  # (batch, seq), 1 for a token to attend to, 0 for padding
            allowed = allowed & attention_mask[:, None, None, :].bool()
        # A query whose keys are all masked gets NaN (softmax over -inf alone): pad at the end, so
        # every query still sees the first token.
        att = (q @ k.transpose(-2, -1)) * self.head_dim ** -0.5
        y = (att.masked_fill(~allowed, float("-inf")).softmax(-1) @ v).transpose(1, 2).reshape(b, t, -1)
        x = x + self.proj(y)
        return x + self.out(nn.functional.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    """A GPT-style language model written as users write one (nanoGPT's shape): token and position
    embeddings, a ModuleList of pre-norm causal blocks looped over in ``forward``, a final norm and
    a head. ``forward(tokens, attention_mask=None)`` returns logits (batch, seq, vocab). Not an
    nn.Sequential: the pipeline cuts it by tracing (``RankStages(model, split_points=["layers.2"],
    example_args=(tokens,))``)."""

    def __init__(self, vocab: int = 256, d_model: int = 64, layers: int = 4, heads: int = 4, seq: int = 32):
        super().__init__()
        self.seq, self.vocab = seq, vocab
        self.tok = nn.Embedding(vocab, d_model)
        self.pos = nn.Embedding(seq, d_model)
        self.layers = nn.ModuleList(Block(d_model, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab)

    def forward(self, tokens: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        h = self.tok(tokens) + self.pos(positions)
        for layer in self.layers:
            h = layer(h, attention_mask)
        return self.head(self.norm(h))


def lm_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of next-token logits (batch, seq, vocab) against token ids (batch, seq)."""
    return nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten())


def model_names() -> list[str]:
    return [*BUILTIN, *OPTIONAL]


def check_model_name(name: str) -> None:
    """Raise ValueError for a name that is neither built in, optional, nor ``module:factory``."""
    if name in BUILTIN or name in OPTIONAL:
        return
    if ":" not in name:
        raise ValueError(f"unknown model {name!r}: choose from {', '.join(model_names())} or give package.module:factory")


# The sizes each built-in model takes (``--model-args``); anything else is a user error.
SIZES = {"mlp": ("depth", "width", "classes"), "transformer": ("vocab", "d_model", "layers", "heads", "seq"),
         "gpt": ("vocab", "d_model", "layers", "heads", "seq")}


def check_workload(name: str, **sizes) -> None:
    """Everything that can be checked without building the model; ValueError with the fix.

    Unknown names and sizes, a missing ``models`` extra, and a ``module:factory`` whose module
    or factory cannot be found all fail here, before any rank is spawned.
    """
    check_model_name(name)
    if name in SIZES:
        unknown = sorted(set(sizes) - set(SIZES[name]))
        if unknown:
            raise ValueError(f"model {name!r} takes sizes {', '.join(SIZES[name])}; got {', '.join(unknown)}")
        bad = {k: v for k, v in sizes.items() if not (isinstance(v, int) and v >= 1)}
        if bad:
            raise ValueError(f"model {name!r}: sizes must be positive integers, got {bad}")
        return
    if name in OPTIONAL:
        if sizes:
            raise ValueError(f"model {name!r} takes no sizes, got {', '.join(sorted(sizes))}")
        _require(OPTIONAL[name], name)
        return
    module_name, _, attr = name.partition(":")
    module = import_user_module(name)
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise ValueError(f"model {name!r}: {module_name!r} has no callable {attr!r}")
    try:  # the sizes go to the factory as keywords: a name it does not take fails here, not on a rank
        signature = inspect.signature(factory)
    except (TypeError, ValueError):  # some builtins and C callables have no signature to check
        return
    try:
        signature.bind(**sizes)
    except TypeError as err:
        takes = ", ".join(p.name for p in signature.parameters.values()
                          if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)) or "no sizes"
        raise ValueError(f"model {name!r}: --model-args {','.join(f'{k}={v}' for k, v in sizes.items()) or '(none)'} "
                         f"do not fit {attr}{signature} ({err}); it takes {takes}") from None


def build_workload(name: str, **sizes) -> Workload:
    """Build the named workload with synthetic data of the right shapes."""
    check_model_name(name)
    if name == "mlp":
        check_workload(name, **sizes)
        width = sizes.get("width", 1024)
        model = mlp(sizes.get("depth", 12), width, classes=sizes.get("classes", 10))
        return Workload(model, _dense_batch((width,), sizes.get("classes", 10)), nn.functional.cross_entropy)
    if name in ("transformer", "gpt"):
        check_workload(name, **sizes)
        model = TinyTransformer(**sizes) if name == "transformer" else GPT(**sizes)
        return Workload(model, _token_batch(model.seq, model.vocab), lm_loss)
    if name in OPTIONAL:
        _require(OPTIONAL[name], name)
        return _resnet50() if name == "resnet50" else _bert()
    attr = name.partition(":")[2]
    try:
        model = getattr(import_user_module(name), attr)(**sizes)  # sizes go to the factory
    except TypeError as err:  # a size the factory does not take
        raise ValueError(f"model {name!r}: {err}") from None
    if not isinstance(model, nn.Module):
        raise ValueError(f"{name} returned {type(model).__name__}, not an nn.Module")
    shape = tuple(getattr(model, "input_shape", ()) or (_first_linear(model).in_features,))
    return Workload(model, _dense_batch(shape, None), _mse_to_zero)


def import_user_module(name: str) -> ModuleType:
    """The module of ``package.module:factory``, imported as ``python -m`` would: the current
    directory first on the path. ValueError naming the module and the directory searched."""
    module_name = name.partition(":")[0]
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:  # `python -c` and `-m` already search it ("")
        sys.path.insert(0, cwd)
    try:
        return importlib.import_module(module_name)
    except ImportError as err:
        raise ValueError(f"model {name!r}: cannot import {module_name!r} ({err}); searched the current directory "
                         f"{cwd} first, then sys.path: run from the directory that holds "
                         f"{module_name.split('.')[0]}/ (or {module_name}.py), or add it to PYTHONPATH") from None


def _require(package: str, model: str) -> None:
    try:
        importlib.import_module(package)
    except ImportError:
        raise ValueError(
            f"model {model!r} needs {package}: install the extra with pip install 'commlab[models]'"
        ) from None


def _resnet50() -> Workload:
    import torchvision

    return Workload(torchvision.models.resnet50(weights=None), _dense_batch((3, 224, 224), 1000), nn.functional.cross_entropy)


def _bert() -> Workload:
    import transformers

    config = transformers.BertConfig()  # bert-base sizes, random weights, no download
    inner = transformers.BertForMaskedLM(config)

    class _Logits(nn.Module):
        def __init__(self):
            super().__init__()
            self.bert = inner

        def forward(self, tokens):
            return self.bert(input_ids=tokens).logits

    return Workload(_Logits(), _token_batch(128, config.vocab_size), lm_loss)


def _dense_batch(shape: tuple[int, ...], classes: int | None):
    def make(batch: int, gen: torch.Generator):
        x = torch.randn(batch, *shape, generator=gen)
        if classes is None:  # the loss ignores it; one per sample, so a pipeline can split it into micro-batches
            return x, torch.zeros(batch)
        return x, torch.randint(0, classes, (batch,), generator=gen)

    return make


def _token_batch(seq: int, vocab: int):
    def make(batch: int, gen: torch.Generator):
        tokens = torch.randint(0, vocab, (batch, seq), generator=gen)
        return tokens, torch.roll(tokens, -1, dims=1)

    return make


def _mse_to_zero(out: torch.Tensor, _target: torch.Tensor) -> torch.Tensor:
    return out.float().pow(2).mean()


def _first_linear(model: nn.Module) -> nn.Linear:
    for m in model.modules():
        if isinstance(m, nn.Linear):
            return m
    raise ValueError("a user model needs an `input_shape` attribute or a Linear layer to infer it from")
