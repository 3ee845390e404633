"""Tracing models into graphs, and the activation sites of each space.

``trace(model, inputs)`` tries ``torch.fx.symbolic_trace`` (works on simple modules such
as timm's ViT; not tried for keyword inputs) and then ``torch.export.export(strict=False)``
(works on Hugging Face models: transformers 5 has no fx tracer of its own). If neither
works, it says why (``ModelGraph.reason``) and returns a graph-less result, so binding by
parameter names still works with the graph features disabled.

The graph is kept as a :class:`networkx.DiGraph` over FX node names; each node records
its op, the module it came from (``nn_module_stack`` for exported graphs), the
parameters it reads and its input nodes in argument order. Activation sites of a space
(what activation matching reads):

- ``pre``: the output of a layer whose weight's output axis is bound to the space alone
  (a linear, an addmm of a Conv1D, an embedding), then ``post`` for elementwise
  functions of it (GELU, SiLU, ReLU, dropout);
- ``post``: the input of a layer whose weight's input axis reads the space (down_proj,
  c_proj, fc2): the features after the nonlinearity whatever it is made of (GPT-2's
  composite tanh-GELU, SwiGLU's silu(gate) * up).
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

import attrs
import networkx as nx
import torch
import torch.fx as fx

from ..problem import Problem

#: ops that map features elementwise (the last dimension keeps its meaning)
ELEMENTWISE = {
    "gelu", "relu", "silu", "tanh", "sigmoid", "dropout", "GELU", "ReLU", "SiLU", "Tanh", "Dropout", "Identity",
    "gelu.default", "relu.default", "silu.default", "tanh.default", "sigmoid.default", "dropout.default",
    "clone.default", "alias.default",
}


@attrs.frozen
class Site:
    """An activation site: a graph node whose feature axis ``dim`` lies in a space."""

    node: str
    dim: int
    kind: str  # "pre": the linear output; "post": after elementwise functions
    module: str = ""


@attrs.define
class ModelGraph:
    method: str  # "symbolic_trace" | "export" | "none"
    reason: str = ""
    graph: nx.DiGraph | None = None
    gm: Any = None  # the fx.GraphModule (or ExportedProgram)
    sites: dict[str, list[Site]] = attrs.field(factory=dict)
    param_users: dict[str, list[str]] = attrs.field(factory=dict)

    @property
    def traced(self) -> bool:
        return self.graph is not None


def _as_tuple(inputs: Any) -> tuple[Any, ...]:
    if isinstance(inputs, tuple):
        return inputs
    if isinstance(inputs, list):
        return tuple(inputs)
    return (inputs,)


def trace(model: torch.nn.Module, example_inputs: Any, problem: Problem | None = None,
          methods: tuple[str, ...] = ("symbolic_trace", "export")) -> ModelGraph:
    reasons = []
    kwargs: dict[str, Any] = {}
    args = example_inputs
    if isinstance(example_inputs, Mapping):
        kwargs, args = dict(example_inputs), ()
    args = _as_tuple(args)
    for method in methods:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                if method == "symbolic_trace":
                    if kwargs:
                        raise RuntimeError("keyword inputs: symbolic_trace is not tried")
                    traced = fx.symbolic_trace(model)
                    g = _symbolic_graph(traced, model)
                    gm: Any = traced
                else:
                    ep = torch.export.export(model, args, kwargs, strict=False)
                    g = _export_graph(ep)
                    gm = ep
        except Exception as e:  # any failure: report why and try the next method
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            reasons.append(f"{method}: {type(e).__name__}: {first[:200]}")
            continue
        mg = ModelGraph(method, "; ".join(reasons), g, gm)
        _param_users(mg)
        if problem is not None:
            find_sites(mg, problem)
        return mg
    return ModelGraph("none", "; ".join(reasons) or "no tracing method")


def _node_attrs(n: fx.Node, module: str, params: list[str], op_name: str) -> dict[str, Any]:
    return {"op": n.op, "target": op_name, "module": module, "params": params, "inputs": [a.name for a in n.all_input_nodes]}


def _symbolic_graph(gm: fx.GraphModule, model: torch.nn.Module) -> nx.DiGraph:
    g = nx.DiGraph()
    for n in gm.graph.nodes:
        params: list[str] = []
        module = ""
        if n.op == "call_module":
            module = str(n.target)
            sub = model.get_submodule(module)
            params = [f"{module}.{k}" for k, _ in sub.named_parameters(recurse=False)]
            op_name = type(sub).__name__
        elif n.op == "get_attr":
            params = [str(n.target)]
            op_name = "get_attr"
        elif n.op in ("call_function", "call_method"):
            op_name = getattr(n.target, "__name__", str(n.target))
        else:
            op_name = n.op
        g.add_node(n.name, **_node_attrs(n, module, params, op_name))
        for inp in n.all_input_nodes:
            g.add_edge(inp.name, n.name)
    return g


def _export_graph(ep: Any) -> nx.DiGraph:
    sig = ep.graph_signature
    inputs_to_params = {**sig.inputs_to_parameters, **sig.inputs_to_buffers}
    g = nx.DiGraph()
    for n in ep.graph.nodes:
        params: list[str] = []
        if n.op == "placeholder" and n.name in inputs_to_params:
            params = [inputs_to_params[n.name]]
        stack = n.meta.get("nn_module_stack") or {}
        module = list(stack.values())[-1][0] if stack else ""
        op_name = str(getattr(n.target, "_overloadpacket", n.target)).split(".")[-1] if n.op == "call_function" else n.op
        if n.op == "call_function":
            op_name = getattr(n.target, "__name__", str(n.target)).split(".")[0]
        g.add_node(n.name, **_node_attrs(n, module, params, op_name))
        for inp in n.all_input_nodes:
            g.add_edge(inp.name, n.name)
    return g


def _param_users(mg: ModelGraph) -> None:
    g = mg.graph
    assert g is not None
    users: dict[str, list[str]] = {}
    for node, data in g.nodes(data=True):
        for p in data.get("params", []):
            if data["op"] == "call_module":
                users.setdefault(p, []).append(node)
            else:
                users.setdefault(p, []).extend(g.successors(node))
    mg.param_users = users


#: linear-like ops -> the weight axis that becomes the output's last dimension
_LINEAR_OUT_AXIS = {"Linear": 0, "linear": 0, "Embedding": 1, "embedding": 1, "addmm": 1, "mm": 1, "matmul": -1}
#: linear-like ops -> the weight axis that reads the input's last dimension
_LINEAR_IN_AXIS = {"Linear": 1, "linear": 1, "addmm": 0, "mm": 0}


def find_sites(mg: ModelGraph, problem: Problem) -> None:
    """Record, per space, the nodes whose last dimension lies in it."""
    g = mg.graph
    if g is None:
        return
    found: dict[str, dict[str, Site]] = {}

    def add(space: str, node: str, kind: str) -> None:
        found.setdefault(space, {}).setdefault(node, Site(node, -1, kind, g.nodes[node].get("module", "")))

    params = {p for data in (g.nodes[n] for n in g.nodes) for p in data.get("params", [])}
    for pname, binding in problem.params.items():
        for user in mg.param_users.get(pname, []):
            data = g.nodes[user]
            op = data["target"]
            if op in _LINEAR_OUT_AXIS and not (op in ("Embedding", "embedding") and pname.endswith("bias")):
                out_axis = _LINEAR_OUT_AXIS[op] % len(binding.shape)
                for ab in binding.axes:
                    if ab.axis != out_axis or len(ab.segments) != 1:
                        continue
                    factors = ab.segments[0].factors
                    if any(f.variance != "co" or f.path for f in factors):
                        continue
                    chain = [user]  # and elementwise functions of it
                    while True:
                        nxt = [s for s in g.successors(chain[-1]) if g.nodes[s]["target"] in ELEMENTWISE]
                        if len(list(g.successors(chain[-1]))) != 1 or len(nxt) != 1:
                            break
                        chain.append(nxt[0])
                    for f in factors:  # a composition (mlp[i] @ scale[i]): a site of each
                        for k, node in enumerate(chain):
                            add(f.space, node, "pre" if k == 0 else "post")
            if op in _LINEAR_IN_AXIS and len(binding.shape) == 2:
                in_axis = _LINEAR_IN_AXIS[op]
                source = next((i for i in data.get("inputs", []) if not (set(g.nodes[i].get("params", [])) & params)), None)
                if source is None:
                    continue
                for ab in binding.axes:
                    if ab.axis != in_axis or len(ab.segments) != 1:
                        continue
                    for f in ab.segments[0].factors:
                        if f.variance == "contra" and not f.path:
                            add(f.space, source, "post")
    mg.sites = {space: list(nodes.values()) for space, nodes in found.items()}
