"""Tensor (intra-layer) parallelism: Megatron's column and row layers on commlab's collectives.

>>> model = parallelize(GPT(), gpt_plan(vocab_parallel=True), sequence_parallel=True)
>>> loss = vocab_parallel_cross_entropy(model(tokens), target)   # the head's logits stay split
>>> loss.backward(); opt.step()                                  # opt over model.parameters()
>>> full = full_state_dict(model)                                # collective: the whole model's values

A plan maps module-name patterns to kinds (``kind_names()``): ``colwise``, ``colwise_gather``,
``rowwise``, ``vocab``, and with ``sequence_parallel=True`` ``sequence``, ``split_sequence``,
``gather_sequence``. ``algorithm`` is any of ``commlab.collectives.algorithm_names()``. The
operators (``copy_to``, ``reduce_from`` and the sequence-parallel pair) are public for models
that place their own collectives. ``record_timings(model)`` stamps every collective, and
``timings(model)`` gives per iteration each layer's time in them, forward and backward (timing.py).
"""

from __future__ import annotations

from commlab.tensor.comm import TPGroup
from commlab.tensor.loss import vocab_parallel_cross_entropy
from commlab.tensor.operators import copy_to, gather, gather_from, reduce_from, reduce_scatter_to, split
from commlab.tensor.parallelize import full_state_dict, parallelize
from commlab.tensor.plan import gpt_plan, kind_names, resolve
from commlab.tensor.timing import record_timings, timings

__all__ = [
    "TPGroup",
    "copy_to",
    "full_state_dict",
    "gather",
    "gather_from",
    "gpt_plan",
    "kind_names",
    "parallelize",
    "record_timings",
    "reduce_from",
    "reduce_scatter_to",
    "resolve",
    "split",
    "timings",
    "vocab_parallel_cross_entropy",
]
