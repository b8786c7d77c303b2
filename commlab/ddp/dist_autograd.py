"""DDP under torch.distributed.autograd: refused with NotImplementedError at the first gradient.

torch's Reducer writes each averaged bucket into the distributed autograd context when a
backward runs there (reducer.cpp, ``runGradCallbackForVariable``). commlab does not: its reducer
hears of gradients through ``register_post_accumulate_grad_hook``, which the distributed engine
never runs (it accumulates into the context instead, dist_engine.cpp,
``DistAccumulateGradCaptureHook``), so the gradients would silently stay un-averaged. What that
engine does run are the post hooks of each parameter's AccumulateGrad node, and in the local
engine those run right after the tensor hook. So, for a forward made inside a distributed
autograd context, :func:`arm` adds such a node hook for that iteration: a defined gradient
reaching a parameter that the reducer still waits for means the tensor hook was skipped, i.e. the
distributed engine runs this backward, and it raises. Every rank's backward meets it at its
first parameter, before any bucket of that backward is reduced, so no rank is left waiting.
A local ``loss.backward()`` inside a context is unaffected.

The distributed engine reports an exception from a Python hook only as "Error on Node N:
python_error", so the hook also writes the reason to stderr, and the DDP keeps it: its next
forward raises the NotImplementedError itself.
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Sequence
from typing import Any

import torch.distributed.autograd as dist_autograd

MESSAGE = (
    "commlab's DistributedDataParallel does not support backward through "
    "torch.distributed.autograd (dist_autograd.backward): the distributed engine does not run the "
    "hooks commlab reduces gradients from; use torch's DistributedDataParallel for RPC-based training"
)


def in_context() -> bool:
    """Whether this thread is inside ``dist_autograd.context()`` (where a forward records RPCs)."""
    if not dist_autograd.is_available():
        return False
    try:
        dist_autograd._current_context()
    except RuntimeError:  # "Current thread doesn't have a valid autograd context"
        return False
    return True


def arm(reducer: Any, accumulators: Sequence) -> list:
    """Node post hooks on ``accumulators`` (the reducer's, by parameter index) that raise when the
    distributed engine runs this backward; remove the returned handles when the iteration ends."""
    me = weakref.ref(reducer)  # as the gradient hooks: the nodes must not keep a dropped DDP alive
    return [acc.register_hook(_check(me, i)) for i, acc in enumerate(accumulators)]


def _check(reducer: weakref.ref, index: int):
    def hook(grad_inputs, grad_outputs):
        live = reducer()
        if live is None or not grad_outputs or grad_outputs[0] is None:
            return
        if live.expect_hooks and not live._marked[index]:
            live.unsupported = MESSAGE
            sys.stderr.write(f"NotImplementedError: {MESSAGE}\n")
            raise NotImplementedError(MESSAGE)

    return hook
