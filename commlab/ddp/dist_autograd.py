"""DDP under torch.distributed.autograd: refused with NotImplementedError, on every rank, at forward.

torch's Reducer writes each averaged bucket into the distributed autograd context when a
backward runs there (reducer.cpp, ``runGradCallbackForVariable``). commlab does not: its reducer
hears of gradients through ``register_post_accumulate_grad_hook``, which the distributed engine
never runs (it accumulates into the context instead, dist_engine.cpp,
``DistAccumulateGradCaptureHook``), so the gradients would silently stay un-averaged.

So a synchronised forward made inside ``dist_autograd.context()`` raises, before any collective of
that iteration: every rank meets it at the same call, none is left waiting. Raising in backward
instead (from a post hook of each parameter's AccumulateGrad node, which that engine does run)
was tried: the engine reports a Python hook's exception only as "Error on Node N: python_error",
and with the DDP inside an RPC model (torch's ``DdpMode.INSIDE`` test) the ranks then hung.
Not caught: a forward made outside any context whose graph is then run by
``dist_autograd.backward`` (the context is what records a forward's RPCs, so RPC models make it
inside one).
"""

from __future__ import annotations

import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc

MESSAGE = (
    "commlab's DistributedDataParallel does not support torch.distributed.autograd: a synchronised "
    "forward inside dist_autograd.context() would be reduced by dist_autograd.backward, whose engine "
    "does not run the hooks commlab reduces gradients from; use torch's DistributedDataParallel for "
    "RPC-based training (no_sync() and torch.no_grad() forwards are allowed)"
)


def in_context() -> bool:
    """Whether this thread is inside ``dist_autograd.context()``. A context needs RPC (init_rpc
    starts distributed autograd), and asking for the current context costs tens of microseconds
    when there is none (a C++ error), so that is asked only with an RPC agent set."""
    if not (rpc.is_available() and dist_autograd.is_available()) or not rpc._is_current_rpc_agent_set():
        return False
    try:
        dist_autograd._current_context()
    except RuntimeError:  # "Current thread doesn't have a valid autograd context"
        return False
    return True
