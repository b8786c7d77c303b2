"""Activation memory of a GPT layer and of a pipeline rank, by Korthikanti et al.'s formulas.

Korthikanti et al. ("Reducing Activation Recomputation in Large Transformer Models", MLSys 2023,
section 4 and Table 2) count the bytes one layer keeps for its backward, with 2-byte activations
and 1-byte dropout masks, for a micro-batch ``b`` of ``s`` tokens, hidden ``h``, ``a`` heads:

    no parallelism                      s b h (34 + 5 a s / h)
    tensor parallel (t)                 s b h (10 + 24 / t + 5 a s / (h t))
    tensor + sequence parallel          s b h / t (34 + 5 a s / h)
    selective recomputation             drops the 5 a s / h term (the attention core's scores,
                                        softmax and dropout, re-run instead of kept)
    full recomputation                  keeps only the layer's input: 2 s b h (/ t with
                                        sequence parallelism, which shards that input too)

A pipeline rank holds several micro-batches at once: with 1F1B the first stage keeps ``p`` of
them for its ``L / p`` layers, L layers' worth in all; interleaving over ``v`` stages per rank
multiplies that by 1 + (p - 1) / (p v) (section 4.2.3). The embedding and output layers' extra
bytes (section 4.2.3's sbhp/t and 4 sbh/t (1 + V/h)) are left out: under 1% for the models here.
Pure functions of the shapes; nothing runs.
"""

from __future__ import annotations

from commlab.costmodel.lowering.transformer import GPT, RECOMPUTE


def per_layer(gpt: GPT, micro_batch: int, tp: int = 1, sequence_parallel: bool = False,
              recompute: str = "none") -> float:
    """Bytes one layer keeps per micro-batch on one of ``tp`` ranks (the table above)."""
    if recompute not in RECOMPUTE:
        raise ValueError(f"recompute must be one of {', '.join(RECOMPUTE)}, got {recompute!r}")
    if tp < 1 or gpt.heads % tp:
        raise ValueError(f"tensor parallel size {tp} must divide the {gpt.heads} attention heads")
    sbh = gpt.seq * micro_batch * gpt.hidden
    if recompute == "full":
        return 2 * sbh / (tp if sequence_parallel else 1)
    core = 0.0 if recompute == "selective" else 5 * gpt.heads * gpt.seq / gpt.hidden
    if sequence_parallel:
        return sbh / tp * (34 + core)
    return sbh * (10 + 24 / tp + core / tp)


def in_flight(pp: int, virtual: int = 1) -> float:
    """Layers' worth of micro-batches the first rank holds, in units of the whole model's layers
    over ``pp`` stages: 1 for 1F1B, 1 + (p - 1) / (p v) interleaved (Korthikanti section 4.2.3)."""
    if pp < 1 or virtual < 1:
        raise ValueError(f"pipeline size and stages per rank must be >= 1, got {pp}, {virtual}")
    return 1.0 if virtual == 1 else 1 + (pp - 1) / (pp * virtual)


def per_rank(gpt: GPT, micro_batch: int, tp: int = 1, pp: int = 1, sequence_parallel: bool = False,
             recompute: str = "none", virtual: int = 1) -> float:
    """Peak activation bytes on the busiest (first) pipeline rank of one tensor-parallel rank."""
    if gpt.layers % (pp * virtual):
        raise ValueError(f"{gpt.layers} layers do not split into {pp} x {virtual} pipeline stages")
    return gpt.layers * per_layer(gpt, micro_batch, tp, sequence_parallel, recompute) * in_flight(pp, virtual)
