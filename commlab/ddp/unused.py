"""Unused parameters: which ones an iteration leaves without a gradient, and what the ranks agree on.

torch's Reducer (torch/csrc/distributed/c10d/reducer.cpp) has three modes, kept here:

- dynamic (``find_unused_parameters=True``, no static graph): every forward searches the graph
  from the outputs; a parameter it cannot reach, or whose hook runs with an undefined gradient
  (an output the loss does not use, passed through the sink with materialize_grads off), is
  *locally unused*; an all-reduce of the "used" map after every backward tells which parameters
  no rank used, and those keep their ``.grad`` untouched (None stays None).
- static (``static_graph=True``): no search. The first iteration finds the unused parameters
  from the hooks that did not run, reduces every bucket at the end of backward and all-reduces
  the map once; later iterations mark those parameters ready at the start of backward and reuse
  the agreed map (torch's ``static_graph_first_iteration`` / ``delay_all_reduce``).
- neither: every parameter must get a gradient. A backward that leaves some without one is not
  an error by itself; the next forward raises torch's "Expected to have finished reduction in
  the prior iteration" (``ensure_prior_reduction_finished``), naming them.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from commlab import collectives
from commlab.ddp.graph import unreached


class UnusedParameters:
    """Per-reducer bookkeeping of unused parameters across iterations (one of the modes above)."""

    def __init__(self, names: Sequence[str], *, find_unused_parameters: bool, static_graph: bool):
        self.names = list(names)
        self.dynamic = find_unused_parameters and not static_graph
        self.static = static_graph
        self.static_first = static_graph  # True until the first synchronised backward ends
        self._static_unused: list[int] = []
        self._no_hook: list[int] = []  # this iteration's parameters whose hook never ran
        self._static_globally_unused: list[bool] | None = None
        self._last_locally_unused: list[int] | None = None  # None: no iteration yet
        self.span: tuple | None = None  # (start, end) of the last used-map all-reduce, when stamped
        self.unfinished: list[int] = []  # torch's require_finalize_ left set, with its culprits
        self.used_unsynced: set[int] = set()  # got a gradient in a backward outside sync (dynamic)

    @property
    def tracking(self) -> bool:
        """Whether this iteration learns which parameters are used (and so tolerates missing ones)."""
        return self.dynamic or self.static_first

    def unused_at_start(self, reached: set | None, accumulator_index: dict) -> list[int]:
        """Parameters to mark ready (with zeros) when backward starts: they will get no hook.
        ``reached``: the graph behind this forward's outputs (:func:`graph.reachable`), dynamic mode."""
        self._no_hook = []
        if self.dynamic:
            return unreached(reached, accumulator_index)
        return list(self._static_unused)

    def note_no_hook(self, indices: Sequence[int]) -> None:
        """Parameters whose hook did not run at all. Only these are static-unused: a hook that
        ran with an undefined gradient counts as triggered (torch's numGradHooksTriggeredMap_),
        so after the first iteration such a parameter is waited for again."""
        self._no_hook = list(indices)

    def rebuild_tail(self) -> list[int]:
        """What a static graph appends to the ready order of its second iteration (the first
        one records none): its unused parameters, in index order, as torch's rebuilt buckets show."""
        return list(self._static_unused) if self.static and not self.static_first else []

    def end_of_backward(self, locally_unused: Sequence[int], group, device, stamp=None) -> list[bool] | None:
        """Which parameters no rank used (None: all were used, nothing to skip). Collective in
        the dynamic mode and the first static iteration; issue it after every bucket. ``stamp``
        (a clock) times the all-reduce itself into ``self.span``."""
        if not self.tracking:
            return self._static_globally_unused
        if self.used_unsynced:
            locally_unused = [i for i in locally_unused if i not in self.used_unsynced]
            self.used_unsynced = set()
        self._last_locally_unused = list(locally_unused)
        used = self.local_used_map(device)
        start: list = []

        def reduce_flags() -> None:
            start.append(stamp() if stamp else None)  # after the group's queue drained: not counted
            dist.all_reduce(used, group=group)

        # On the group's one ordered path: never inside another thread's p2p batch (collectives/worker.py).
        collectives.run_ordered(group, reduce_flags)
        self.span = (start[0], stamp() if stamp else None)
        flags = (used == 0).tolist()
        globally_unused = flags if any(flags) else None
        if self.static_first:
            self.static_first = False
            self._static_unused = sorted(self._no_hook)
            self._static_globally_unused = globally_unused
        return globally_unused

    def local_used_map(self, device) -> torch.Tensor:
        """1 for each parameter this rank used in its last tracked iteration (zeros before any):
        also what a joined rank contributes, as torch's joined ranks reduce their stale map."""
        if self._last_locally_unused is None:
            return torch.zeros(len(self.names), dtype=torch.int32, device=device)
        used = torch.ones(len(self.names), dtype=torch.int32, device=device)
        used[self._last_locally_unused] = 0
        return used

    def check_prior_finished(self, group, sparse_unfinished: Sequence[str] = ()) -> None:
        """Raise torch's error if the last synchronised backward left parameters without gradient
        (``sparse_unfinished``: sparse parameters that did, commlab/ddp/sparse.py)."""
        if self.unfinished or sparse_unfinished:  # (get_rank only here: it costs on every forward)
            missing = [self.names[i] for i in self.unfinished] + list(sparse_unfinished)
            raise RuntimeError(prior_reduction_error(missing, self, dist.get_rank(group)))


def prior_reduction_error(missing: Sequence[str], mode: UnusedParameters, rank: int) -> str:
    """torch's message (reducer.cpp, ensure_prior_reduction_finished), naming the parameters as
    torch does under TORCH_DISTRIBUTED_DEBUG=DETAIL."""
    first = "Expected to have finished reduction in the prior iteration before starting a new one. "
    if mode.static:
        why = (
            "This error indicates that your training graph has changed in this iteration, e.g. one "
            "parameter is used in the first iteration but unused in the second; this is not "
            "compatible with static_graph=True. "
        )
    elif mode.dynamic:
        why = (
            "This error indicates that your module has parameters that were not used in producing "
            "loss. Since `find_unused_parameters=True` is enabled, this likely means that not all "
            "`forward` outputs participate in computing loss. "
        )
    else:
        why = (
            "This error indicates that your module has parameters that were not used in producing "
            "loss. You can enable unused parameter detection by passing the keyword argument "
            "`find_unused_parameters=True` to DistributedDataParallel, and by making sure all "
            "`forward` function outputs participate in calculating loss. "
        )
    return f"{first}{why}Parameters which did not receive grad for rank {rank}: {', '.join(missing)}"
