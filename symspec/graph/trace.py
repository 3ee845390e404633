"""Tracing a model into a torch.fx graph.

``trace(model, inputs)`` tries ``torch.fx.symbolic_trace`` (simple modules such as timm's
ViT; not tried for keyword inputs), then ``torch.export.export(strict=False)`` (Hugging
Face models: transformers 5 has no fx tracer of its own). If neither works it says why
(:attr:`ModelGraph.reason`) and returns a graph-less result, so binding by parameter
names still works with the graph features (activation sites) off.

The graph stays the FX graph itself (:attr:`ModelGraph.graph`); :class:`Node` is the
little that site finding needs of each FX node: its op, the module it came from
(``nn_module_stack`` for exported graphs) and the parameters it reads.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator, Mapping
from typing import Any

import attrs
import torch
import torch.fx as fx

from ..problem import Problem, Site


@attrs.frozen
class Node:
    """What site finding reads of one FX node."""

    name: str
    op: str  # placeholder | get_attr | call_module | call_function | call_method | output
    target: str  # the module class or function name (``Linear``, ``linear``, ``addmm``, ...)
    module: str  # the module it belongs to ("" when unknown)
    params: tuple[str, ...]  # the parameters (and buffers) it reads directly
    fx: fx.Node = attrs.field(eq=False, repr=False)

    @property
    def inputs(self) -> list[str]:
        return [a.name for a in self.fx.all_input_nodes]

    @property
    def users(self) -> list[str]:
        return [u.name for u in self.fx.users]


@attrs.define
class ModelGraph:
    """A traced model: ``method`` is ``symbolic_trace``, ``export`` or ``none`` (then
    ``reason`` says why). ``gm``: the ``fx.GraphModule`` (symbolic trace) or the
    ``ExportedProgram``; ``graph``: its ``fx.Graph``. ``sites``: space -> the
    :class:`~symspec.problem.Site` s where data shows it (filled when traced with a
    problem)."""

    method: str
    reason: str = ""
    gm: Any = None
    graph: fx.Graph | None = None
    nodes: dict[str, Node] = attrs.field(factory=dict)
    sites: dict[str, list[Site]] = attrs.field(factory=dict)
    #: parameter name -> the nodes that compute with it (a module call, or the users of
    #: the node that reads it)
    param_users: dict[str, list[str]] = attrs.field(factory=dict)

    @property
    def traced(self) -> bool:
        return self.graph is not None

    def has_node(self, name: str) -> bool:
        return name in self.nodes

    def all_sites(self) -> tuple[Site, ...]:
        """Every site once (a site with several spaces is listed under each)."""
        return tuple({s.name: s for sites in self.sites.values() for s in sites}.values())

    def runnable(self) -> fx.GraphModule:
        """A GraphModule whose parameter names are the model's own (the exported
        program unlifted), for :mod:`.recorder`."""
        return self.gm.module() if self.method == "export" else self.gm


def call_args(inputs: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Example inputs as positional and keyword arguments (a dict: keywords; a tuple or
    list: positional; anything else: one positional input)."""
    if isinstance(inputs, Mapping):
        return (), dict(inputs)
    if isinstance(inputs, (tuple, list)):
        return tuple(inputs), {}
    return (inputs,), {}


def trace(model: torch.nn.Module, example_inputs: Any, problem: Problem | None = None,
          methods: tuple[str, ...] = ("symbolic_trace", "export")) -> ModelGraph:
    """Trace ``model`` on ``example_inputs`` (see the module); with ``problem``, find the
    activation sites of its spaces (:func:`~.sites.find_sites`)."""
    args, kwargs = call_args(example_inputs)
    reasons = []
    for method in methods:
        try:
            with warnings.catch_warnings(), _no_cache(model):
                warnings.simplefilter("ignore")
                if method == "symbolic_trace":
                    if kwargs:
                        raise RuntimeError("keyword inputs: symbolic_trace is not tried")
                    gm: Any = fx.symbolic_trace(model)
                    graph, nodes = gm.graph, dict(_symbolic_nodes(gm, model))
                else:
                    gm = torch.export.export(model, args, kwargs, strict=False)
                    graph, nodes = gm.graph, dict(_export_nodes(gm))
        except Exception as e:  # any failure: report why and try the next method
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            reasons.append(f"{method}: {type(e).__name__}: {first[:200]}")
            continue
        mg = ModelGraph(method, "; ".join(reasons), gm, graph, nodes)
        mg.param_users = _param_users(mg)
        if problem is not None:
            from .sites import find_sites  # here: sites imports this module (ModelGraph, Node)

            mg.sites = by_space(find_sites(mg, problem))
        return mg
    return ModelGraph("none", "; ".join(reasons) or "no tracing method")


@contextlib.contextmanager
def _no_cache(model: torch.nn.Module) -> Iterator[None]:
    """A Hugging Face model's key/value cache off while tracing: its cache object is no
    tensor, and an exported graph that returns one cannot be run (nothing here decodes)."""
    config = getattr(model, "config", None)
    if getattr(config, "use_cache", None) is not True:
        yield
        return
    config.use_cache = False
    try:
        yield
    finally:
        config.use_cache = True


def by_space(sites: tuple[Site, ...]) -> dict[str, list[Site]]:
    out: dict[str, list[Site]] = {}
    for site in sites:
        for space in sorted(site.spaces()):
            out.setdefault(space, []).append(site)
    return out


def _symbolic_nodes(gm: fx.GraphModule, model: torch.nn.Module) -> Iterator[tuple[str, Node]]:
    for n in gm.graph.nodes:
        params: tuple[str, ...] = ()
        module = ""
        if n.op == "call_module":
            module = str(n.target)
            sub = model.get_submodule(module)
            params = tuple(f"{module}.{k}" for k, _ in sub.named_parameters(recurse=False))
            target = type(sub).__name__
        elif n.op == "get_attr":
            params, target = (str(n.target),), "get_attr"
        elif n.op in ("call_function", "call_method"):
            target = getattr(n.target, "__name__", str(n.target))
        else:
            target = n.op
        yield n.name, Node(n.name, n.op, target, module, params, n)


def _export_nodes(ep: Any) -> Iterator[tuple[str, Node]]:
    sig = ep.graph_signature
    lifted = {**sig.inputs_to_parameters, **sig.inputs_to_buffers}
    for n in ep.graph.nodes:
        params = (lifted[n.name],) if n.op == "placeholder" and n.name in lifted else ()
        stack = n.meta.get("nn_module_stack") or {}
        module = list(stack.values())[-1][0] if stack else ""
        target = getattr(n.target, "__name__", str(n.target)).split(".")[0] if n.op == "call_function" else n.op
        yield n.name, Node(n.name, n.op, target, module, params, n)


def _param_users(mg: ModelGraph) -> dict[str, list[str]]:
    users: dict[str, list[str]] = {}
    for node in mg.nodes.values():
        for p in node.params:
            users.setdefault(p, []).extend([node.name] if node.op == "call_module" else node.users)
    return users
