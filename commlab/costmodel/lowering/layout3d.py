"""A Megatron GPT's 3D layout (tensor x pipeline x data parallel) lowered onto the simulator core.

One iteration of a GPT on ``tp * pp * dp`` GPUs, as Megatron-LM runs it (Narayanan et al.,
SC 2021; Korthikanti et al., MLSys 2023):

- each pipeline stage holds ``layers / (pp v)`` consecutive layers (``v`` stages per rank with
  the interleaved schedule), the first the embedding, the last the logits and the loss; a
  stage's forward and backward per micro-batch are its operators' times
  (:mod:`commlab.costmodel.lowering.transformer`) plus its tensor-parallel collectives
  (:mod:`commlab.costmodel.lowering.tensor`), which sit on the layer's critical path; the
  backward includes the recomputed forward (full or selective);
- the schedule (1F1B, or interleaved 1F1B as Narayanan et al. ran Table 1) is the registry's,
  priced by :func:`commlab.costmodel.lowering.pipeline.lower`: the real schedule, every
  micro-batch, every message (10-25 s for 64 stages x 512 micro-batches on a shared 2-core VM);
- a boundary's activation (``b s h`` 2-byte elements) goes from each tensor-parallel rank to its
  peer in the next stage, a ``1 / t`` share each over the GPU's own NIC (Narayanan et al.'s
  scatter/gather optimisation, section 4.1; with sequence parallelism the activation is split
  already), and without sequence parallelism is all-gathered over NVLink on arrival;
- after its last backward each rank all-reduces its gradients (2-byte, Megatron's local DDP,
  after the flush) over its data-parallel group: ``dp`` ranks, ``8 / tp`` of them on a node,
  the node's ``tp`` groups sharing its NICs; the first and last stages first all-reduce the tied
  embedding's gradient between them; then the optimizer (Adam: 7 fp32 values read or written per
  parameter, memory-bound).

Every data-parallel replica runs the same pipeline, so one pipeline is simulated. Compute and
communication are assumed not to slow each other: the only communication beside compute here is
the stage-to-stage messages (the tensor-parallel collectives sit between operators, the gradient
all-reduces after the flush), at most 2.8% of a stage's compute in Narayanan et al.'s Table 1
rows, so a compute slowdown of about 20% while NCCL runs would move a stage by under 0.6%.
Data loading and logging are left out.
"""

from __future__ import annotations

from dataclasses import dataclass

from commlab.costmodel.hardware import nccl
from commlab.costmodel.hardware.presets import OPTIMIZER_BYTES_PER_GRAD_BYTE
from commlab.costmodel.lowering import activations, tensor, transformer as tf
from commlab.costmodel.hardware.nccl import Group, collective_seconds
from commlab.costmodel.lowering.pipeline import lower
from commlab.costmodel.terms.costs import PointToPoint, StageProfile, SystemCosts
from commlab.pipeline.schedule.actions import flatten
from commlab.pipeline.schedule.registry import build
from commlab.sim import Task
from commlab.sim import simulate as run_tasks

SCHEDULES = ("1f1b", "interleaved")


@dataclass(frozen=True)
class Layout:
    """How a GPT is split: tensor ``tp``, pipeline ``pp`` (``virtual`` stages per rank with
    ``schedule`` interleaved), data ``dp``; ``global_batch`` samples in ``micro_batch`` pieces."""

    tp: int
    pp: int
    dp: int
    micro_batch: int
    global_batch: int
    schedule: str = "1f1b"
    virtual: int = 1
    recompute: str = "full"
    sequence_parallel: bool = False

    @property
    def gpus(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def microbatches(self) -> int:
        return self.global_batch // (self.micro_batch * self.dp)

    def check(self, gpt: tf.GPT, gpus: int | None = None) -> None:
        """ValueError for a layout this GPT cannot run (before anything is priced)."""
        if min(self.tp, self.pp, self.dp, self.micro_batch, self.global_batch, self.virtual) < 1:
            raise ValueError(f"every size of a layout must be >= 1, got {self}")
        if gpus is not None and self.gpus != gpus:
            raise ValueError(f"tp x pp x dp = {self.tp} x {self.pp} x {self.dp} = {self.gpus}, not the {gpus} GPUs given")
        if gpt.heads % self.tp:
            raise ValueError(f"tensor parallel size {self.tp} must divide the {gpt.heads} attention heads")
        if gpt.layers % (self.pp * self.virtual):
            raise ValueError(f"{gpt.layers} layers do not split into {self.pp} x {self.virtual} pipeline stages")
        if self.global_batch % (self.micro_batch * self.dp):
            raise ValueError(f"global batch {self.global_batch} is not a whole number of micro-batches of "
                             f"{self.micro_batch} on each of {self.dp} data-parallel replicas")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {', '.join(SCHEDULES)}, got {self.schedule!r}")
        if self.schedule == "1f1b" and self.virtual != 1:
            raise ValueError("1f1b runs one stage per rank: use schedule 'interleaved' for virtual > 1")
        if self.recompute not in tf.RECOMPUTE:
            raise ValueError(f"recompute must be one of {', '.join(tf.RECOMPUTE)}, got {self.recompute!r}")
        if self.schedule == "interleaved" and self.microbatches % self.pp:
            raise ValueError(f"interleaved 1F1B needs micro-batches ({self.microbatches}) to be a multiple of pp ({self.pp})")


@dataclass(frozen=True)
class Machine:
    """A cluster: its links (NCCL's view) and its device class."""

    network: nccl.Network
    device: tf.Device


def stage_profile(gpt: tf.GPT, layout: Layout, machine: Machine) -> StageProfile:
    """Seconds of each stage's forward and backward (recomputation included) per micro-batch."""
    b, t, sp, dev, net = layout.micro_batch, layout.tp, layout.sequence_parallel, machine.device, machine.network
    ops = tf.layer_ops(gpt, b, t, sp)
    comm = tensor.layer(gpt, b, t, sp, layout.recompute)
    f_layer = tf.forward_seconds(ops, dev) + tensor.seconds(comm["forward"], net, t)
    b_layer = (tf.backward_seconds(ops, dev) + tensor.seconds(comm["backward"], net, t)
               + tf.recompute_seconds(ops, dev, layout.recompute) + tensor.seconds(comm["recompute"], net, t))
    stages = layout.pp * layout.virtual
    per_stage = gpt.layers // stages
    end = tensor.ends(gpt, b, t, sp)
    emb, logits = tf.embedding_ops(gpt, b, t, sp), tf.logits_ops(gpt, b, t, sp)
    forward, backward = [per_stage * f_layer] * stages, [per_stage * b_layer] * stages
    forward[0] += tf.forward_seconds(emb, dev) + tensor.seconds(end["embedding"], net, t)
    backward[0] += tf.backward_seconds(emb, dev)
    forward[-1] += tf.forward_seconds(logits, dev) + tensor.seconds(end["logits_forward"], net, t)
    backward[-1] += tf.backward_seconds(logits, dev) + tensor.seconds(end["logits_backward"], net, t)
    message = b * gpt.seq * gpt.hidden * tf.BYTES
    return StageProfile(tuple(forward), tuple(backward), message_bytes=(message,) * stages)


def message_seconds(gpt: tf.GPT, layout: Layout, network: nccl.Network) -> float:
    """One boundary's activation (or its gradient) between stages (the module docstring)."""
    x = layout.micro_batch * gpt.seq * gpt.hidden * tf.BYTES
    t = layout.tp
    across = layout.gpus > network.gpus_per_node and layout.tp * layout.dp >= network.gpus_per_node
    # a send is NCCL's two-rank broadcast; the tp ranks of a node send at once, each over its own NIC
    pair = Group(2, 1, sharing=min(t, network.gpus_per_node)) if across else Group(2, 2)
    seconds = collective_seconds(network, "broadcast", x / t, pair)
    if t > 1 and not layout.sequence_parallel:
        seconds += collective_seconds(network, "all_gather", x, tensor.group(network, t))
    return seconds


def data_parallel_group(layout: Layout, network: nccl.Network) -> Group:
    """``dp`` ranks, one per tensor-parallel group of consecutive ranks: ``gpus_per_node / tp``
    of them on a node, the node's other groups sharing its NICs (Megatron's rank order)."""
    per_node = max(1, min(layout.dp, network.gpus_per_node // layout.tp))
    return Group(layout.dp, per_node, sharing=max(1, network.gpus_per_node // per_node) if layout.dp > per_node else 1)


def parameters_per_rank(gpt: tf.GPT, layout: Layout) -> list[float]:
    """Parameters on each pipeline rank of one tensor-parallel rank: its layers' 12 h^2 + 13 h,
    the first and last stages' share of the tied embedding (V h / t each)."""
    per_layer = (12 * gpt.hidden ** 2 + 13 * gpt.hidden) / layout.tp
    layers = gpt.layers // layout.pp
    counts = [layers * per_layer] * layout.pp
    counts[0] += gpt.vocab * gpt.hidden / layout.tp + gpt.seq * gpt.hidden
    counts[-1] += gpt.vocab * gpt.hidden / layout.tp if layout.pp > 1 else 0.0
    return counts


@dataclass(frozen=True)
class Iteration:
    seconds: float
    tflops_per_gpu: float  # Narayanan et al.'s equation 3 (recomputation counted) over seconds and GPUs
    activation_bytes: float  # per rank, Korthikanti et al.'s formulas (the busiest, first rank)
    profile: StageProfile


def predict(gpt: tf.GPT, layout: Layout, machine: Machine, gpus: int | None = None) -> Iteration:
    """One iteration's time on the simulator core (the module docstring)."""
    layout.check(gpt, gpus)
    net = machine.network
    profile = stage_profile(gpt, layout, machine)
    actions = build(layout.schedule, layout.pp, layout.microbatches, layout.virtual)
    # Every message has the same size, so its one time is the channel's fixed cost.
    system = SystemCosts(p2p=PointToPoint(alpha_s=message_seconds(gpt, layout, net)))
    tasks = lower(actions, system, profile, lookahead=False)  # NCCL posts receives in schedule order
    tasks += _step_tail(gpt, layout, machine, [str(rank[-1]) for rank in flatten(actions)])
    result = run_tasks(tasks)
    flops = tf.model_flops(gpt, layout.global_batch, recompute=layout.recompute == "full")
    memory = activations.per_rank(gpt, layout.micro_batch, layout.tp, layout.pp, layout.sequence_parallel,
                                  layout.recompute, layout.virtual)
    return Iteration(result.makespan, flops / result.makespan / layout.gpus / 1e12, memory, profile)


def _step_tail(gpt: tf.GPT, layout: Layout, machine: Machine, last: list[str]) -> list[Task]:
    """Per rank after its last action: the tied embedding's all-reduce (first and last stage),
    the data-parallel all-reduce, the optimizer (the module docstring)."""
    net, out = machine.network, []
    dp_group = data_parallel_group(layout, net)
    pair = Group(2, 1, sharing=min(layout.tp, net.gpus_per_node))
    for r, params in enumerate(parameters_per_rank(gpt, layout)):
        deps = (last[r],)
        if layout.pp > 1 and r in (0, layout.pp - 1):
            embedding = gpt.vocab * gpt.hidden / layout.tp * tf.BYTES
            out.append(Task(f"embedding allreduce {r}", f"dp{r}", collective_seconds(net, "all_reduce", embedding, pair),
                            deps, kind="allreduce"))
            deps = (f"embedding allreduce {r}",)
        out.append(Task(f"dp allreduce {r}", f"dp{r}", collective_seconds(net, "all_reduce", params * tf.BYTES, dp_group),
                        deps, kind="allreduce"))
        adam = OPTIMIZER_BYTES_PER_GRAD_BYTE * 4 * params  # fp32 main gradient: 4 bytes a parameter
        out.append(Task(f"optimizer {r}", f"rank{r}", machine.device.seconds(0.0, adam), (f"dp allreduce {r}",),
                        kind="optimizer"))
    return out


def machine_on(preset: dict, efficiency: float) -> Machine:
    """A hardware preset's links and device (peak FLOP/s, memory bandwidth) at ``efficiency``."""
    from commlab.costmodel.hardware.presets import network

    return Machine(network(preset), tf.Device(float(preset["peak_tflops"]) * 1e12, float(preset["hbm_gbps"]) * 1e9,
                                              efficiency))
