"""The facts :func:`~symspec.inference.walk.read_graph` gathers from an exported graph
(layers, norms, attention products, experts; axis classes and roles), and the helpers that
read a traced node."""

from __future__ import annotations

import operator
import re
from typing import Any

import attrs
import torch
import torch.fx as fx

from ..graph.ops import ops_with
from .axes import Axes, Layout

#: what the walk knows of each op (one table with activation sites: symspec.graph.ops)
NONLINEAR = ops_with("nonlinear")
HOMOGENEOUS = ops_with("homogeneous")
ACTIVATIONS = ops_with("activation")
ODD = ops_with("odd")
TRANSPARENT = ops_with("transparent")
RESHAPE = ops_with("reshape")
PERMUTE = ops_with("permute")
NO_TENSOR = ops_with("no_tensor")
REDUCE = ops_with("reduce")


@attrs.define
@attrs.define
class Linear:
    weight: str
    read_axis: int  # the weight axis contracted with the input's features
    write_axis: int  # the weight axis that becomes the output's features
    bias: str | None
    input: str  # the node it reads
    output: str


@attrs.define
class Norm:
    kind: str  # "layernorm" | "rms"
    gain: str | None
    offset: float
    bias: str | None
    atom: int  # the normalised class
    output: str  # the node after gain and bias
    module: str


@attrs.define
class Attention:
    q: Layout  # the within-head atoms (last dims) and head atoms
    k: Layout
    v: Layout
    qh: Layout
    kh: Layout
    node: str
    module: str
    kv: int = 0  # key/value heads before they were repeated for the query heads (0: as many as query heads)


@attrs.define
class ExpertUse:
    """A mixture-of-experts product: a weight with a leading expert axis applied to the
    rows routed to each expert (``W[index] @ x``, a grouped matmul)."""

    weight: str
    expert_axis: int  # the weight axis that counts the experts
    read_axis: int
    write_axis: int
    router: str | None  # the weight whose softmax and top-k chose the experts
    expert_atom: int  # the class of the router's outputs (= the expert axis)
    input: str  # the node it reads
    output: str


@attrs.define
class Facts:
    axes: Axes
    #: parameter -> atom per axis
    param_atoms: dict[str, list[int]]
    #: parameter -> axis -> roles
    roles: dict[str, dict[int, set[str]]]
    #: every parameter name -> the names sharing its tensor (ties), including itself
    aliases: dict[str, tuple[str, ...]]
    linears: list[Linear]
    norms: list[Norm]
    attentions: list[Attention]
    #: (node of the gated product, the weight whose output is the linear factor, the
    #: other factor, and for a fused weight split by a chunk: the piece's index and node)
    gates: list[tuple[Any, ...]]
    #: (node of the homogeneous unit, the weight whose output it reads)
    homogeneous: list[tuple[str, str]]
    #: node name -> the users of it (after transparent ops), for folding decisions
    consumers: dict[str, list[tuple[str, str, int]]]
    #: ops that could not be read: op name -> count
    unknown: dict[str, int]
    #: node name -> module path
    modules: dict[str, str]
    method: str = "export"
    #: node name -> the traced node (in graph order)
    nodes: dict[str, fx.Node] = attrs.field(factory=dict)
    #: (parameter, axis) -> (role, the activation node it writes or reads, a gain's input node)
    sites: dict[tuple[str, int], set[tuple[str, str, str]]] = attrs.field(factory=dict)
    #: node -> the atom of its last dim (where it is one atom)
    node_atom: dict[str, int] = attrs.field(factory=dict)
    #: mixture-of-experts products (their weights are not in ``linears``)
    experts: list[ExpertUse] = attrs.field(factory=list)
    #: node name -> why a rule failed on it (:func:`unreadable`); its axes stay invariant
    unreadable: dict[str, str] = attrs.field(factory=dict)


def opname(n: fx.Node) -> str:
    if n.op != "call_function":
        return n.op
    t = n.target
    if t is operator.getitem:
        return "getitem"
    name = getattr(t, "__name__", str(t))
    return name.split(".")[0]


def val_of(n: Any) -> Any:
    return n.meta.get("val") if isinstance(n, fx.Node) else None


def is_integral(v: Any) -> bool:
    """An integer or boolean tensor (or a tuple of them): indices, counts, masks."""
    if isinstance(v, torch.Tensor):
        return not v.is_floating_point() and not v.is_complex()
    if isinstance(v, (tuple, list)) and v:
        return all(isinstance(x, torch.Tensor) and not x.is_floating_point() for x in v)
    return False


def shape_of(n: Any) -> tuple[int, ...] | None:
    v = val_of(n)
    if isinstance(v, torch.Tensor):
        try:
            return tuple(int(s) for s in v.shape)
        except TypeError:  # symbolic sizes
            return None
    return None


class Sub:
    """A view of a node with only some of its dims (the batch dims of a matmul)."""

    def __init__(self, node: fx.Node, lay: list[Layout]) -> None:
        self.node = node
        self.lay = lay


def source_line(n: fx.Node) -> str:
    """Where the user's code made node ``n``: the innermost frame of its stack trace
    (``file:line, in fn: code``), or the module that ran it, or ''."""
    trace = [line.strip() for line in (n.meta.get("stack_trace") or "").splitlines() if line.strip()]
    frames = [i for i, line in enumerate(trace) if line.startswith("File ")]
    if frames:
        m = re.match(r'File "([^"]*)", line (\d+), in (.*)', trace[frames[-1]])
        code = trace[frames[-1] + 1] if frames[-1] + 1 < len(trace) and not trace[frames[-1] + 1].startswith("File ") else ""
        if m:
            return f"{m.group(1)}:{m.group(2)}, in {m.group(3)}" + (f": {code}" if code else "")
    stack = n.meta.get("nn_module_stack") or {}
    if stack:
        path, cls = list(stack.values())[-1]
        return f"in {path or 'the model'} ({getattr(cls, '__name__', cls)})"
    return ""


def unreadable(n: fx.Node, error: BaseException) -> str:
    """Why inference could not read node ``n``, as fx's Interpreter reports a failure
    ("While executing ..."): the node, the user's source line, and the error's message.

    >>> g = fx.Graph()
    >>> relu = g.call_function(torch.relu, (g.placeholder("x"),))
    >>> unreadable(relu, ValueError("no rule fits"))
    'while reading %relu : [num_users=0] = call_function[target=torch.relu](args = (%x,), kwargs = {}): ValueError: no rule fits'
    """
    where = source_line(n)
    message = " ".join(str(error).split())[:300]
    return (f"while reading {n.format_node()}" + (f" ({where})" if where else "")
            + f": {type(error).__name__}" + (f": {message}" if message else ""))
