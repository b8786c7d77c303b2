"""Steps lowered onto the simulator core (commlab/sim): every prediction runs through one of these.

- buckets.py: a sequence of data-parallel buckets as collective tasks, which every lowering composes;
- ddp.py: one DDP optimizer step, and its sweep columns;
- zero.py: one sharded step (ZeRO stages 1-3), with its peak bytes per rank and bytes sent;
- pipeline.py: a pipeline schedule's step (and, with data parallelism, each stage's buckets);
- layout3d.py: a Megatron GPT's tensor x pipeline x data-parallel iteration at scale, from
  transformer.py (a layer's operators: FLOPs, bytes, roofline time), tensor.py (tensor- and
  sequence-parallel collectives) and activations.py (Korthikanti et al.'s activation memory).
"""
