"""A GPT layer's compute, operator by operator: FLOPs and bytes, and their time on a device.

A Megatron GPT layer (Shoeybi et al. 2019; Narayanan et al., SC 2021, section 3.2) is a fixed
list of operators. Each one's FLOPs and the bytes it moves through device memory follow from the
shapes alone: micro-batch ``b``, sequence ``s``, hidden ``h``, heads ``a``, vocabulary ``V``,
split ``t`` ways by tensor parallelism (the GEMMs and the attention core by heads; with sequence
parallelism the layer norms and dropouts by sequence too). Activations and weights are 2-byte
(fp16/bf16, the mixed precision the papers ran). An operator lasts its roofline time divided by
the device's one efficiency:

    seconds = max(FLOPs / peak FLOP/s, bytes / memory bandwidth) / efficiency

so a GEMM of a wide model is compute-bound and the softmax over ``b a s^2`` scores is bandwidth-
bound: the same efficiency makes a narrow model (h = 2304) slower per FLOP than a wide one,
as Narayanan et al.'s Table 1 shows (137 vs 163 TFLOP/s per GPU), without a second number.

Backward: a GEMM runs two GEMMs of its forward's FLOPs (input and weight gradients), each moving
what the forward moved (ASSUMED: the same operand sizes). An elementwise operator reads the
output gradient and its saved inputs and writes the input gradient: its forward's reads twice
and its writes once. Recomputation re-runs forward operators before the backward: all of them
(full; Narayanan et al. section 3.5) or the attention core, scores to context (selective;
Korthikanti et al., MLSys 2023, section 5).

:func:`model_flops` is Narayanan et al.'s equation 3, the count behind their TFLOP/s figures.
"""

from __future__ import annotations

from dataclasses import dataclass

BYTES = 2  # fp16 / bf16 activations and weights
MASK = 1  # a dropout mask element (torch's bool)
RECOMPUTE = ("none", "full", "selective")


@dataclass(frozen=True)
class GPT:
    """A GPT's shape: ``layers`` transformer layers of width ``hidden`` with ``heads`` heads,
    ``seq`` tokens per sample, a ``vocab``-entry tied embedding (Megatron's GPT)."""

    layers: int
    hidden: int
    heads: int
    seq: int = 2048
    vocab: int = 51200

    def __post_init__(self) -> None:
        if min(self.layers, self.hidden, self.heads, self.seq, self.vocab) < 1:
            raise ValueError(f"a GPT's sizes must be positive, got {self}")
        if self.hidden % self.heads:
            raise ValueError(f"hidden {self.hidden} must be a multiple of heads {self.heads}")

    def parameters(self) -> float:
        """12 l h^2 (1 + 13 / (12 h) + (V + s) / (12 l h)): Narayanan et al. section 5.1's count."""
        l, h = self.layers, self.hidden
        return 12 * l * h * h * (1 + 13 / (12 * h) + (self.vocab + self.seq) / (12 * l * h))


@dataclass(frozen=True)
class Op:
    """One operator of one micro-batch on one tensor-parallel rank (forward)."""

    name: str
    flops: float
    reads: float  # bytes
    writes: float  # bytes
    gemm: bool = False
    attention_core: bool = False  # what selective recomputation re-runs


@dataclass(frozen=True)
class Device:
    """A device class: peak FLOP/s (dense fp16/bf16), memory bandwidth (B/s), and the one
    efficiency (0-1] every operator reaches of its roofline."""

    peak_flops: float
    memory_bw: float
    efficiency: float

    def __post_init__(self) -> None:
        if not (self.peak_flops > 0 and self.memory_bw > 0 and 0 < self.efficiency <= 1):
            raise ValueError(f"a device needs positive peaks and an efficiency in (0, 1], got {self}")

    def seconds(self, flops: float, nbytes: float) -> float:
        return max(flops / self.peak_flops, nbytes / self.memory_bw) / self.efficiency


def _check_split(gpt: GPT, tp: int) -> None:
    if tp < 1 or gpt.heads % tp:
        raise ValueError(f"tensor parallel size {tp} must divide the {gpt.heads} attention heads")
    if gpt.vocab % tp:
        raise ValueError(f"tensor parallel size {tp} must divide the vocabulary {gpt.vocab}")


def layer_ops(gpt: GPT, micro_batch: int, tp: int = 1, sequence_parallel: bool = False) -> tuple[Op, ...]:
    """One transformer layer's forward operators on one of ``tp`` ranks, in order."""
    _check_split(gpt, tp)
    b, s, h, a, t = micro_batch, gpt.seq, gpt.hidden, gpt.heads, tp
    x = b * s * h * BYTES  # one full activation
    n = x / t if sequence_parallel else x  # what a norm or a dropout sees on this rank
    scores = b * a * s * s / t  # attention scores on this rank, elements
    ops = []

    def gemm(name: str, k: int, m: int, split_out: bool) -> Op:
        # (b s, k) x (k, m) with the weight split t ways by columns (split_out) or by rows
        flops = 2 * b * s * k * m / t
        inp = b * s * k * BYTES / (1 if split_out else t)
        out = b * s * m * BYTES / (t if split_out else 1)
        return Op(name, flops, inp + k * m * BYTES / t, out, gemm=True)

    def norm(name: str) -> Op:
        return Op(name, 0.0, n, n)

    def dropout_add(name: str) -> Op:  # Megatron's fused bias-dropout-add: x and the residual in, one out
        return Op(name, 0.0, 2 * n, n + n / BYTES * MASK)

    ops += [norm("layernorm1"), gemm("qkv", h, 3 * h, True)]
    ops += [Op("scores", 2 * b * s * s * h / t, 2 * x / t, scores * BYTES, gemm=True, attention_core=True),
            Op("softmax", 0.0, scores * BYTES, scores * BYTES, attention_core=True),  # fused scale-mask-softmax
            Op("attention_dropout", 0.0, scores * BYTES, scores * (BYTES + MASK), attention_core=True),
            Op("context", 2 * b * s * s * h / t, scores * BYTES + x / t, x / t, gemm=True, attention_core=True)]
    ops += [gemm("projection", h, h, False), dropout_add("dropout_add1"), norm("layernorm2"),
            gemm("fc1", h, 4 * h, True), Op("bias_gelu", 0.0, 4 * x / t, 4 * x / t),  # fused bias-GeLU
            gemm("fc2", 4 * h, h, False), dropout_add("dropout_add2")]
    return tuple(ops)


def logits_ops(gpt: GPT, micro_batch: int, tp: int = 1, sequence_parallel: bool = False) -> tuple[Op, ...]:
    """The last stage's extra work: final layer norm, the vocabulary-parallel logits GEMM
    (weights tied to the embedding) and the cross-entropy over its ``V / t`` logits."""
    _check_split(gpt, tp)
    b, s, h, t, v = micro_batch, gpt.seq, gpt.hidden, tp, gpt.vocab
    x = b * s * h * BYTES
    logits = b * s * v / t * BYTES
    return (Op("final_layernorm", 0.0, x / t if sequence_parallel else x, x / t if sequence_parallel else x),
            Op("logits", 2 * b * s * h * v / t, x + h * v / t * BYTES, logits, gemm=True),
            Op("cross_entropy", 0.0, 2 * logits, logits))  # max, then exp-sum over the logits; softmax out


def embedding_ops(gpt: GPT, micro_batch: int, tp: int = 1, sequence_parallel: bool = False) -> tuple[Op, ...]:
    """The first stage's extra work: token and position rows gathered, added, dropped out."""
    x = micro_batch * gpt.seq * gpt.hidden * BYTES
    n = x / tp if sequence_parallel else x
    return (Op("embedding", 0.0, 2 * x, x), Op("embedding_dropout", 0.0, n, n + n / BYTES * MASK))


def forward_seconds(ops: tuple[Op, ...], device: Device) -> float:
    return sum(device.seconds(o.flops, o.reads + o.writes) for o in ops)


def backward_seconds(ops: tuple[Op, ...], device: Device) -> float:
    """Input and weight gradients (the module docstring's rule)."""
    total = 0.0
    for o in ops:
        if o.gemm:  # two GEMMs: input gradient and weight (or, in the attention core, the other operand's)
            total += 2 * device.seconds(o.flops, o.reads + o.writes)
        else:
            total += device.seconds(0.0, 2 * o.reads + o.writes)
    return total


def recompute_seconds(ops: tuple[Op, ...], device: Device, recompute: str) -> float:
    """The forward work re-run before a backward: none, all (full) or the attention core (selective)."""
    if recompute not in RECOMPUTE:
        raise ValueError(f"recompute must be one of {', '.join(RECOMPUTE)}, got {recompute!r}")
    if recompute == "none":
        return 0.0
    return forward_seconds(tuple(o for o in ops if recompute == "full" or o.attention_core), device)


def model_flops(gpt: GPT, batch: int, recompute: bool = True) -> float:
    """FLOPs of one iteration over ``batch`` samples: Narayanan et al. (SC 2021) equation 3,
    96 B s l h^2 (1 + s / (6h) + V / (16 l h)), which counts the recomputed forward; without it,
    72 B s l h^2 (1 + s / (6h) + V / (12 l h)) (Korthikanti et al., section 6.3, model FLOPs)."""
    B, s, l, h, V = batch, gpt.seq, gpt.layers, gpt.hidden, gpt.vocab
    if recompute:
        return 96 * B * s * l * h * h * (1 + s / (6 * h) + V / (16 * l * h))
    return 72 * B * s * l * h * h * (1 + s / (6 * h) + V / (12 * l * h))
