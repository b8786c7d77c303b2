"""Cutting any module into pipeline stages by tracing: torch.export's graph, cut before named submodules.

    traced = trace_stages(model, ["layers.2"], example_args=(tokens,), example_kwargs={"attention_mask": mask})
    traced.parts[1]((h, mask))                   # each stage takes and returns a tuple of tensors

The graph is torch.distributed.pipelining's: :func:`torch.distributed.pipelining.pipeline` traces
the model with torch.export on one example micro-batch and splits the graph before each split
point (``SplitPoint.BEGINNING``), and its stage modules keep the original model's parameters
(shared, not copied) under their original names. What this module adds is what commlab's
executor needs of a stage: one value in, one value out, sent to the next stage only. A stage's
input is the tuple of every value that crosses the cut before it: values computed by earlier
stages and the model's own inputs that this stage or a later one reads (a keyword argument such
as an attention mask rides along from the first stage, as torch's split graph passes it to
every stage that reads it). Only floating-point values carry a gradient back; integer token ids
and masks simply travel.

The stages are static-shape, as torch's are: every micro-batch must have the example's shapes.
The boundaries (what crosses each cut) are found once, by running the stages on the example
under ``no_grad``, so no rank needs a shape handshake. Parameters shared across stages (tied
input and output embeddings) are refused with the parameter names: each stage would keep its own
copy and the copies' gradients would need an all-reduce, which commlab does not do (torch's
``pipeline`` copies such a parameter into each stage that uses it).
"""

from __future__ import annotations

import inspect
import operator
from dataclasses import dataclass

import torch
from torch import fx, nn
from torch.distributed.pipelining import SplitPoint, pipeline
from torch.utils import _pytree as pytree

from commlab.pipeline.runtime.values import MAX_PARTS, flat


@dataclass(frozen=True)
class Traced:
    """A model cut into ``parts`` (one :class:`GraphStage` per stage). ``spec``: the pytree
    structure of ``(args, kwargs)`` that ``step()`` must pass, ``inputs``: each input tensor's
    traced (micro-batch) shape and dtype, ``names``: a readable name for each, ``carried[s]``:
    the (shape, dtype) of each tensor crossing into stage s (``carried[0]`` is the inputs),
    ``order``: the names of ``model.forward``'s parameters (keyword arguments go in this order)."""

    parts: tuple[nn.Module, ...]
    spec: pytree.TreeSpec
    inputs: tuple[tuple[tuple[int, ...], torch.dtype], ...]
    names: tuple[str, ...]
    carried: tuple[tuple[tuple[tuple[int, ...], torch.dtype], ...], ...]
    order: tuple[str, ...]


class GraphStage(nn.Module):
    """One stage of a traced model: reads the values crossing into it (``takes``), calls its piece
    of the graph (``inner``, whose parameters keep the model's names), and returns what crosses out
    (``gives``): a tuple, or the model's output on the last stage."""

    def __init__(self, inner: nn.Module, takes: tuple[str, ...], args: tuple[str, ...], outs: str | tuple[str, ...],
                 gives: tuple[str, ...], last: bool):  # fmt: skip
        super().__init__()
        self.inner = inner
        self.takes, self.args, self.outs, self.gives, self.last = takes, args, outs, gives, last

    def forward(self, value):
        env = dict(zip(self.takes, flat(value)))
        out = self.inner(*(env[k] for k in self.args))
        if isinstance(self.outs, str):
            env[self.outs] = out
        else:
            env.update(zip(self.outs, out))
        result = tuple(env[k] for k in self.gives)
        return result[0] if self.last and len(result) == 1 else result

    def place(self, device: torch.device) -> GraphStage:
        """Move to ``device``, with the tensors the graph creates (``torch.arange(..., device=)``,
        baked in as the example's device when traced) created there too."""
        self.to(device)
        for module in self.inner.modules():
            if isinstance(module, fx.GraphModule):
                for node in module.graph.nodes:
                    if isinstance(node.kwargs.get("device"), torch.device):
                        node.update_kwarg("device", device)
                module.recompile()
        return self


def flatten_inputs(order: tuple[str, ...], args: tuple, kwargs: dict | None) -> tuple[list, pytree.TreeSpec]:
    """The leaves of ``(args, kwargs)`` in the order torch.export numbers the graph's inputs:
    keyword arguments in ``order``, that of ``model.forward``'s parameters."""
    kwargs = dict(kwargs or {})
    ordered = {k: kwargs[k] for k in sorted(kwargs, key=lambda k: order.index(k) if k in order else len(order))}
    return pytree.tree_flatten((tuple(args), ordered))


def check_split_points(model: nn.Module, split_points) -> list[str]:
    """``split_points`` as a list; ValueError for a name that is no submodule, the root, or a repeat."""
    if isinstance(split_points, str) or not split_points:
        raise ValueError(f"split_points is a non-empty list of submodule names (e.g. ['layers.2']), got {split_points!r}")
    points = [str(p) for p in split_points]
    modules = dict(model.named_modules())
    for p in points:
        if not p or p not in modules:
            children = ", ".join(n for n, _ in model.named_children())
            raise ValueError(f"split point {p!r} names no submodule of {type(model).__name__} "
                             f"(its children: {children}; nested ones as 'layers.4')")  # fmt: skip
    repeated = sorted({p for p in points if points.count(p) > 1})
    if repeated:
        raise ValueError(f"split points {repeated} are given more than once")
    return points


def trace_stages(model: nn.Module, split_points, example_args: tuple, example_kwargs: dict | None = None) -> Traced:
    """Cut ``model`` before each of ``split_points`` (module docstring); ValueError for bad input.

    Needs no process group, so a launcher can call it to refuse bad input before any rank starts.
    """
    points = check_split_points(model, split_points)
    if not isinstance(example_args, tuple):
        raise ValueError(f"example_args is a tuple of one micro-batch's positional inputs, got {type(example_args).__name__}")
    order = tuple(inspect.signature(model.forward).parameters)
    leaves, spec = flatten_inputs(order, example_args, example_kwargs)
    if not leaves or not all(isinstance(t, torch.Tensor) for t in leaves):
        raise ValueError("every example input must be a tensor (a micro-batch of the inputs step() will take), got "
                         + ", ".join(type(t).__name__ for t in leaves))  # fmt: skip
    args, kwargs = pytree.tree_unflatten(leaves, spec)
    try:
        pipe = pipeline(model, mb_args=args, mb_kwargs=kwargs or None,
                        split_spec={p: SplitPoint.BEGINNING for p in points})  # fmt: skip
    except Exception as err:  # torch.export's many error types: say what failed and why, in one line
        reason = next((line for line in str(err).splitlines() if line.strip()), type(err).__name__)
        raise ValueError(f"torch.export cannot trace {type(model).__name__} for the pipeline: {reason} "
                         "(data-dependent control flow or a graph break; see torch.export's docs)") from err  # fmt: skip
    finally:
        for p in points:  # pipeline() wraps the split modules' forward in place: put it back
            found = model.get_submodule(p)
            found.__dict__.pop("forward", None)
            found.__dict__.pop("_orig_forward", None)
    parts = _stages(pipe.split_gm, len(leaves))
    _check_cut(model, parts, points)
    names = tuple(("args" if path[0].idx == 0 else "kwargs") + pytree.keystr(path[1:])
                  for path, _ in pytree.tree_flatten_with_path((args, kwargs))[0])  # fmt: skip
    with torch.no_grad():
        carried, value = [], tuple(leaves)
        for part in parts:
            carried.append(tuple((tuple(t.shape), t.dtype) for t in flat(value)))
            value = part(value)
    too_many = [s for s, c in enumerate(carried) if len(c) > MAX_PARTS]
    if too_many:
        raise ValueError(f"{len(carried[too_many[0]])} tensors cross into stage {too_many[0]}: at most {MAX_PARTS} may")
    return Traced(tuple(parts), spec, tuple((tuple(t.shape), t.dtype) for t in leaves), names, tuple(carried),
                  order)


def _stages(gm: fx.GraphModule, inputs: int) -> list[GraphStage]:
    """One :class:`GraphStage` per ``call_module`` node of torch's split graph, in graph order."""
    roots = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    if len(roots) != inputs:
        raise ValueError(f"the traced graph takes {len(roots)} inputs, the example gives {inputs}")
    calls = [n for n in gm.graph.nodes if n.op == "call_module"]
    output = next(n for n in gm.graph.nodes if n.op == "output")
    made: dict[str, int] = {r: -1 for r in roots}  # value -> the stage that computes it (-1: an input)
    outs: list[str | tuple[str, ...]] = []
    for s, call in enumerate(calls):
        if call.kwargs:
            raise ValueError(f"stage {s} of the traced graph takes keyword arguments, which commlab cannot pass")
        items = {u.args[1]: u.name for u in call.users if u.op == "call_function" and u.target is operator.getitem}
        if items:
            outs.append(tuple(items.get(i, f"{call.name}.{i}") for i in range(max(items) + 1)))
            made.update({k: s for k in outs[-1]})
        else:
            outs.append(call.name)
            made[call.name] = s
    readers: dict[str, int] = {}  # value -> the last stage that reads it (len(calls): the output)
    for s, call in enumerate(calls):
        for a in call.args:
            readers[_name(a, s)] = s
    final = tuple(_name(a, len(calls)) for a in pytree.tree_leaves(output.args))
    for k in final:
        readers[k] = len(calls)
    order = list(made)
    crossing = [tuple(k for k in order if made[k] < s <= readers.get(k, -1)) for s in range(len(calls))]
    crossing[0] = tuple(roots)
    parts = []
    for s, call in enumerate(calls):
        last = s == len(calls) - 1
        gives = final if last else crossing[s + 1]
        parts.append(GraphStage(gm.get_submodule(call.target), crossing[s], tuple(_name(a, s) for a in call.args),
                                outs[s], gives, last))  # fmt: skip
    return parts


def _name(arg, stage: int) -> str:
    if not isinstance(arg, fx.Node):
        raise ValueError(f"stage {stage} of the traced graph takes a constant {arg!r}; commlab passes tensors only")
    return arg.name


def _check_cut(model: nn.Module, parts: list[GraphStage], points: list[str]) -> None:
    """Stage s + 1 starts with split point s; tied parameters stay within one stage."""
    if len(parts) != len(points) + 1:
        raise ValueError(f"{len(points)} split points gave {len(parts)} stages, not {len(points) + 1}: a split point "
                         "that forward never calls, or one nested inside another")  # fmt: skip
    for s, p in enumerate(points):
        here = dict(parts[s + 1].inner.named_modules())
        if p not in here:
            raise ValueError(f"split points {points} are not in the order forward calls them: stage {s + 1} does not "
                             f"hold {p!r}")  # fmt: skip
    where: dict[str, int] = {n: s for s, part in enumerate(parts) for n, _ in part.inner.named_parameters(remove_duplicate=False)}
    names: dict[int, list[str]] = {}
    for n, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(n)
    for tied in names.values():
        if len({where[n] for n in tied if n in where}) > 1:
            raise ValueError(f"parameters {tied} are one tensor used by stages "
                             f"{sorted({where[n] for n in tied if n in where})}: parameters shared across stages "
                             "(tied embeddings) are not supported; untie them or keep their users in one stage")  # fmt: skip
