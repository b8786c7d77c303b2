"""Tensor (and sequence) parallelism's collectives in one GPT layer, and their time.

Megatron's tensor parallelism (Shoeybi et al. 2019, section 3) splits the attention block and the
MLP block of a layer across ``t`` GPUs; each block starts with an identity whose backward is an
all-reduce (f) and ends with an all-reduce whose backward is an identity (g). A layer therefore
all-reduces one activation, ``b s h`` 2-byte elements, twice in its forward and twice in its
backward. Sequence parallelism (Korthikanti et al., MLSys 2023, section 4.2.2) replaces each
all-reduce by an all-gather before the block and a reduce-scatter after it: the same bytes on
the ring, in two halves; the backward runs the pair reversed, and gathers the block's input once
more for the weight gradient (Megatron recomputes that all-gather rather than keep it, and
launches it beside the input-gradient GEMM, so it is marked overlapped: Korthikanti's Table 4
shows the sequence-parallel backward no slower than the plain one). A fully recomputed forward
re-runs the forward's collectives; selective recomputation re-runs only the attention core,
which has none.

Every collective runs on the tensor-parallel group, inside one node when ``t`` fits one (NVLink),
priced by :func:`commlab.costmodel.hardware.nccl.collective_seconds`; the overlapped ones
add nothing to the layer's time. The embedding's and the logits' collectives (one all-reduce or
reduce-scatter of ``b s h`` each way) are the first and last stages' (:func:`ends`).
"""

from __future__ import annotations

from dataclasses import dataclass

from commlab.costmodel.hardware import nccl
from commlab.costmodel.hardware.nccl import Group, collective_seconds
from commlab.costmodel.lowering.transformer import BYTES, GPT


@dataclass(frozen=True)
class Collective:
    op: str  # all_reduce, all_gather, reduce_scatter
    nbytes: float  # the all-reduce's input, the all-gather's output, the reduce-scatter's input
    overlapped: bool = False  # hidden behind compute (off the layer's critical path)


def layer(gpt: GPT, micro_batch: int, tp: int, sequence_parallel: bool = False,
          recompute: str = "none") -> dict[str, tuple[Collective, ...]]:
    """One layer's collectives per pass on one tensor-parallel rank: ``forward``, ``backward``
    and ``recompute`` (the forward's again under full recomputation, else none)."""
    if tp < 1 or gpt.heads % tp:
        raise ValueError(f"tensor parallel size {tp} must divide the {gpt.heads} attention heads")
    if tp == 1:
        return {"forward": (), "backward": (), "recompute": ()}
    x = micro_batch * gpt.seq * gpt.hidden * BYTES
    if sequence_parallel:
        block_fwd = (Collective("all_gather", x), Collective("reduce_scatter", x))
        block_bwd = (Collective("all_gather", x), Collective("all_gather", x, overlapped=True),
                     Collective("reduce_scatter", x))
    else:
        block_fwd = (Collective("all_reduce", x),)
        block_bwd = (Collective("all_reduce", x),)
    forward = block_fwd * 2  # attention, MLP
    return {"forward": forward, "backward": block_bwd * 2, "recompute": forward if recompute == "full" else ()}


def ends(gpt: GPT, micro_batch: int, tp: int, sequence_parallel: bool = False) -> dict[str, tuple[Collective, ...]]:
    """The vocabulary-parallel embedding's forward all-reduce (sequence parallel: reduce-scatter)
    and the logits' input-gradient all-reduce (sequence parallel: their input all-gathered in
    forward, its gradient reduce-scattered in backward)."""
    if tp == 1:
        return {"embedding": (), "logits_forward": (), "logits_backward": ()}
    x = micro_batch * gpt.seq * gpt.hidden * BYTES
    if sequence_parallel:
        return {"embedding": (Collective("reduce_scatter", x),), "logits_forward": (Collective("all_gather", x),),
                "logits_backward": (Collective("reduce_scatter", x),)}
    return {"embedding": (Collective("all_reduce", x),), "logits_forward": (),
            "logits_backward": (Collective("all_reduce", x),)}


def group(network: nccl.Network, tp: int) -> Group:
    """The tensor-parallel group: ``tp`` consecutive ranks (Megatron's order), on one node when
    they fit; NVSwitch gives each GPU its own links, so groups on a node share nothing."""
    return Group(tp, min(tp, network.gpus_per_node))


def seconds(collectives: tuple[Collective, ...], network: nccl.Network, tp: int) -> float:
    """Time the collectives add to their pass: the sum of those not overlapped."""
    if tp == 1:
        return 0.0
    g = group(network, tp)
    return sum(collective_seconds(network, c.op, c.nbytes, g) for c in collectives if not c.overlapped)
