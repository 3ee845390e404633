"""Reading an exported graph into axis classes and the facts a spec needs.

:func:`read_graph` walks the ATen graph of ``torch.export`` once, giving every tensor a
layout per dimension (:mod:`.axes`) and recording:

- for every parameter axis, its atom and its role: ``co`` (it writes features: a layer's
  output rows, a bias, an embedding table's columns, a class token), ``contra`` (it reads
  them: a layer's input columns), ``gain`` (it multiplies them elementwise: a norm's gain),
  ``index`` (an embedding's vocabulary), ``kernel``;
- the linear layers (weight, the axis that reads, the axis that writes, bias);
- the norms (LayerNorm or RMS, gain and its offset, bias) and where their output goes;
- the attention products (q, k, v and output layouts; grouped key/value heads);
- the gated products (``act(gate) * up``) and positively homogeneous units (ReLU);
- tags on classes (see :mod:`.lattice`).

Ops it does not know make their inputs' and outputs' classes opaque: those stay invariant.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any

import attrs
import torch
import torch.fx as fx

from .axes import Axes, Layout

#: elementwise functions that are not linear (permutations commute with them)
NONLINEAR = {
    "gelu", "silu", "tanh", "sigmoid", "exp", "log", "sqrt", "rsqrt", "erf", "softplus", "mish", "hardswish",
    "hardsigmoid", "elu", "selu", "celu", "gelu_", "silu_", "pow", "reciprocal", "sin", "cos", "abs", "sign",
    "square", "log_softmax", "logit", "hardtanh", "relu6", "clamp", "clamp_min", "clamp_max", "where",
    "gt", "lt", "ge", "le", "eq", "ne", "isnan", "isinf", "logical_not", "bitwise_not", "floor", "ceil", "round",
}
#: positively homogeneous: f(a x) = a f(x) for a > 0 (positive scalings pass them)
HOMOGENEOUS = {"relu", "relu_", "leaky_relu", "prelu", "threshold"}
#: activation functions (what a sign flip cannot pass unless the function is odd)
ACTIVATIONS = {"gelu", "silu", "sigmoid", "exp", "softplus", "mish", "hardswish", "hardsigmoid", "elu", "selu", "celu",
               "relu", "leaky_relu", "relu6", "prelu", "threshold", "tanh", "erf", "abs", "square", "softmax", "_softmax"}
#: odd elementwise functions: f(-x) = -f(x), so sign flips pass them too
ODD = {"tanh", "erf", "sin", "sign", "hardtanh", "asinh", "atan", "sinh"}
#: ops that keep every axis as it is and are linear (or copies)
TRANSPARENT = {
    "clone", "alias", "contiguous", "dropout", "detach", "to", "_to_copy", "type_as", "lift_fresh_copy",
    "feature_dropout", "alpha_dropout", "native_dropout", "neg", "positive", "_assert_tensor_metadata",
    "view_as", "copy", "identity",
}
RESHAPE = {"view", "reshape", "_unsafe_view", "flatten", "unflatten", "squeeze", "unsqueeze", "view_copy",
           "reshape_as", "expand", "expand_as", "broadcast_to"}
PERMUTE = {"transpose", "permute", "t", "swapaxes", "movedim", "numpy_T", "mT"}
NO_TENSOR = {"sym_size", "sym_numel", "_assert_scalar", "sym_constrain_range_for_size", "_assert_tensor_metadata",
             "scalar_tensor", "arange", "zeros", "ones", "full", "empty", "ones_like", "zeros_like", "full_like",
             "empty_like", "new_ones", "new_zeros", "new_full", "new_empty", "_local_scalar_dense", "item"}
REDUCE = {"mean", "sum", "var", "std", "var_mean", "amax", "amin", "max", "min", "norm", "linalg_vector_norm",
          "logsumexp", "prod", "argmax", "argmin", "std_mean", "any", "all"}


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


def _opname(n: fx.Node) -> str:
    if n.op != "call_function":
        return n.op
    t = n.target
    if t is operator.getitem:
        return "getitem"
    name = getattr(t, "__name__", str(t))
    return name.split(".")[0]


def _val(n: Any) -> Any:
    return n.meta.get("val") if isinstance(n, fx.Node) else None


def _integral(v: Any) -> bool:
    """An integer or boolean tensor (or a tuple of them): indices, counts, masks."""
    if isinstance(v, torch.Tensor):
        return not v.is_floating_point() and not v.is_complex()
    if isinstance(v, (tuple, list)) and v:
        return all(isinstance(x, torch.Tensor) and not x.is_floating_point() for x in v)
    return False


def _shape(n: Any) -> tuple[int, ...] | None:
    v = _val(n)
    if isinstance(v, torch.Tensor):
        try:
            return tuple(int(s) for s in v.shape)
        except TypeError:  # symbolic sizes
            return None
    return None


class _Reader:
    def __init__(self, ep: Any, model: torch.nn.Module) -> None:
        self.ep = ep
        self.ax = Axes()
        self.lay: dict[str, Any] = {}  # node -> list[Layout] (or a list of them for tuples)
        self.feature: dict[str, bool] = {}  # depends on a parameter or a float input
        self.src: dict[str, tuple[str, tuple[int | None, ...]]] = {}  # node -> (param, node dim -> param axis)
        self.gainlike: dict[str, tuple[str, float]] = {}
        self.linear_out: dict[str, str] = {}  # node -> weight whose output it is (transparent chain)
        self.facts = Facts(self.ax, {}, {}, {}, [], [], [], [], [], {}, {}, {})
        self.gain_at: dict[str, tuple[str, float, str]] = {}  # node -> (gain parameter, offset, normalised node)
        self.squares: set[str] = set()
        #: a chunk or split of a layer's output along its features: node -> (weight, pieces)
        self.pieces_of: dict[str, tuple[str, int]] = {}
        #: one piece of it: node -> (weight, piece index)
        self.linear_piece: dict[str, tuple[str, int]] = {}
        #: nodes that carry a routing decision (top-k indices and what is computed from
        #: them): node -> (the class of the router's outputs, the router's weight)
        self.routed: dict[str, tuple[int, str | None]] = {}
        #: a stack of weights gathered per row: node -> (parameter, node dim -> axis, the
        #: router's output class and the router when routed experts picked them, else None)
        self.expert_rows: dict[str, tuple[str, tuple[int | None, ...], int | None, str | None]] = {}
        self.module = ""
        sig = ep.graph_signature
        self.placeholders = {**sig.inputs_to_parameters, **sig.inputs_to_buffers}
        self.params = set(sig.inputs_to_parameters.values())
        self.consts = set(getattr(sig, "inputs_to_lifted_tensor_constants", {}) or {})
        names: dict[int, list[str]] = {}
        for name, p in model.named_parameters(remove_duplicate=False):
            names.setdefault(id(p), []).append(name)
        for group in names.values():
            for name in group:
                self.facts.aliases[name] = tuple(group)

    # -- helpers -----------------------------------------------------------------------
    def L(self, n: Any) -> list[Layout] | None:
        if not isinstance(n, fx.Node):
            return None
        lay = self.lay.get(n.name)
        return lay if isinstance(lay, list) and (not lay or isinstance(lay[0], tuple)) else None

    def feat(self, n: Any) -> bool:
        return isinstance(n, fx.Node) and self.feature.get(n.name, False)

    def role(self, n: Any, dim: int, role: str, at: Any = None, src: Any = None) -> None:
        """Record ``role`` on the parameter axis that dim ``dim`` of node ``n`` is; ``at``:
        the activation it writes or reads there (``src``: a gain's normalised input)."""
        if not isinstance(n, fx.Node) or n.name not in self.src:
            return
        pname, amap = self.src[n.name]
        own = pname
        pname = self.alias(pname)
        if pname != own:
            self.facts.param_atoms.setdefault(pname, self.facts.param_atoms[own])
        if dim < 0:
            dim += len(amap)
        if 0 <= dim < len(amap) and amap[dim] is not None:
            self.facts.roles.setdefault(pname, {}).setdefault(amap[dim], set()).add(role)
            if isinstance(at, fx.Node):
                self.facts.sites.setdefault((pname, amap[dim]), set()).add((role, at.name, getattr(src, "name", "")))

    def alias(self, pname: str) -> str:
        """The name a tied parameter has in the module that uses it here (``lm_head.weight``
        for the embedding table read by the head), else its own."""
        names = self.facts.aliases.get(pname, (pname,))
        if len(names) > 1:
            leaf = pname.rsplit(".", 1)[-1]
            mine = f"{self.module}.{leaf}" if self.module else leaf
            if mine in names:
                return mine
        return pname

    def fresh_layouts(self, shape: Sequence[int], *tags: str) -> list[Layout]:
        return [(self.ax.fresh(s, *tags),) if s > 1 else () for s in shape]

    def opaque(self, n: fx.Node, name: str) -> None:
        for a in n.all_input_nodes:
            lay = self.L(a)
            if lay and self.feat(a):
                self.ax.tag([x for d in lay for x in d], f"opaque:{name}")
        shape = _shape(n)
        if shape is not None:
            self.lay[n.name] = self.fresh_layouts(shape, f"opaque:{name}")
        self.feature[n.name] = any(self.feat(a) for a in n.all_input_nodes)
        self.facts.unknown[name] = self.facts.unknown.get(name, 0) + 1

    def broadcast(self, out_shape: Sequence[int], operands: Sequence[Any], unify: bool = True) -> list[Layout]:
        """Elementwise broadcasting: the output dims from the operands' (unified where both
        have size > 1)."""
        nd = len(out_shape)
        out: list[Layout | None] = [None] * nd
        for x in operands:
            lay = x.lay if isinstance(x, _Sub) else self.L(x)
            if lay is None:
                continue
            off = nd - len(lay)
            for i, d in enumerate(lay):
                j = off + i
                if not d or (out_shape[j] <= 1 and not (out[j] and len(d) == 1 and len(out[j]) == 1)):
                    continue  # a size-1 dim is unified only between two pieces cut from features
                if out[j] is None:
                    out[j] = d
                elif unify:
                    self.ax.unify_layouts(out[j], d)
        return [o if o is not None else ((self.ax.fresh(s),) if s > 1 else ()) for o, s in zip(out, out_shape)]

    # -- the walk ----------------------------------------------------------------------
    def run(self) -> Facts:
        for n in self.ep.graph.nodes:
            stack = n.meta.get("nn_module_stack") or {}
            self.facts.modules[n.name] = self.module = list(stack.values())[-1][0] if stack else ""
            try:
                self.node(n)
            except Exception as e:  # a rule that did not fit this node: opaque, never wrong
                self.opaque(n, f"{_opname(n)} ({type(e).__name__})")
        self.ax.close()
        for name, lay in self.lay.items():
            if isinstance(lay, list) and lay and isinstance(lay[-1], tuple) and len(lay[-1]) == 1:
                self.facts.node_atom[name] = lay[-1][0]
        return self.facts

    def node(self, n: fx.Node) -> None:
        op = _opname(n)
        if n.op == "placeholder":
            return self.placeholder(n)
        if n.op == "output":
            for a in n.all_input_nodes:
                lay = self.L(a)
                if lay:
                    self.ax.tag([x for d in lay for x in d], "observable")
            return None
        if n.op != "call_function":
            return self.opaque(n, n.op)
        shape = _shape(n)
        inputs = n.all_input_nodes
        # integer results (indices, counts, masks) are no features, whatever they came from
        self.feature[n.name] = any(self.feat(a) for a in inputs) and not _integral(_val(n))
        routed = next((self.routed[a.name] for a in inputs if a.name in self.routed), None)
        if routed is not None and op not in ("index", "getitem", "bmm", "matmul", "grouped_mm_fallback", "_grouped_mm"):
            self.routed[n.name] = routed  # a routing decision sorted, counted, reshaped
        if op in NO_TENSOR:
            if shape is not None:
                self.lay[n.name] = self.fresh_layouts(shape)
            return None
        if op.endswith("_") and not op.startswith("_") and op not in ("gelu_", "silu_", "relu_"):
            op = op[:-1]  # in-place variants (add_, mul_) compute the same values
        handler = getattr(self, f"op_{op}", None)
        if handler is not None:
            return handler(n, shape)
        if op in TRANSPARENT:
            return self.transparent(n, shape)
        if op in RESHAPE:
            return self.reshape(n, shape)
        if op in PERMUTE:
            return self.permute(n, shape)
        if op in NONLINEAR or op in HOMOGENEOUS:
            return self.elementwise(n, shape, op)
        if op in REDUCE:
            return self.reduce(n, shape, op)
        if not self.feature[n.name]:  # mask and position arithmetic: no feature axis involved
            if shape is not None:
                self.lay[n.name] = self.fresh_layouts(shape)
            return None
        return self.opaque(n, op)

    def placeholder(self, n: fx.Node) -> None:
        shape = _shape(n)
        if shape is None:
            return
        pname = self.placeholders.get(n.name)
        if pname is not None and pname in self.params:
            atoms = [self.ax.fresh(s) for s in shape]
            self.lay[n.name] = [(a,) if s > 1 else () for a, s in zip(atoms, shape)]
            for other in self.facts.aliases.get(pname, ()):  # one tensor under two names: the same classes
                if other in self.facts.param_atoms:
                    for a, b in zip(atoms, self.facts.param_atoms[other]):
                        self.ax.unify(a, b)
            self.facts.param_atoms[pname] = atoms
            self.src[n.name] = (pname, tuple(range(len(shape))))
            self.feature[n.name] = True
            if len(shape) == 1:
                self.gainlike[n.name] = (pname, 0.0)
            return
        v = _val(n)
        data = pname is None and n.name not in self.consts
        floating = isinstance(v, torch.Tensor) and v.is_floating_point() and data
        # a model input is data; a floating-point buffer or constant is a table the spec cannot move
        tags = ("data",) if data else ("buffer",) if isinstance(v, torch.Tensor) and v.is_floating_point() else ()
        self.lay[n.name] = self.fresh_layouts(shape, *tags)
        self.feature[n.name] = floating

    # -- shape ops ---------------------------------------------------------------------
    def transparent(self, n: fx.Node, shape: Any) -> None:
        x = n.args[0] if n.args else None
        lay = self.L(x)
        if lay is None or shape is None or len(lay) != len(shape):
            return self.opaque(n, _opname(n)) if self.feature[n.name] else None
        self.lay[n.name] = list(lay)
        if isinstance(x, fx.Node):
            for d in (self.src, self.gainlike, self.linear_out):
                if x.name in d:
                    d[n.name] = d[x.name]

    def reshape(self, n: fx.Node, shape: Any) -> None:
        x = n.args[0]
        lay = self.L(x)
        if lay is None or shape is None:
            return self.opaque(n, _opname(n))
        op = _opname(n)
        if op in ("expand", "expand_as", "broadcast_to"):
            off = len(shape) - len(lay)
            out = [((self.ax.fresh(s),) if s > 1 else ()) for s in shape[:off]]
            for i, d in enumerate(lay):
                s = shape[off + i]
                out.append(d if d or s <= 1 else (self.ax.fresh(s),))
            self.lay[n.name] = out
            if x.name in self.src:
                p, amap = self.src[x.name]
                self.src[n.name] = (p, (None,) * off + tuple(amap))
            return None
        self.lay[n.name] = self.ax.regroup(lay, shape)
        if x.name in self.src:  # a parameter viewed with only size-1 dims added or removed
            p, amap = self.src[x.name]
            xs = _shape(x) or ()
            big_in = [amap[i] for i, s in enumerate(xs) if s > 1]
            big_out = [i for i, s in enumerate(shape) if s > 1]
            if len(big_in) == len(big_out) and [xs[i] for i, s in enumerate(xs) if s > 1] == [shape[i] for i in big_out]:
                m: list[int | None] = [None] * len(shape)
                for i, a in zip(big_out, big_in):
                    m[i] = a
                self.src[n.name] = (p, tuple(m))
        if x.name in self.linear_out:
            self.linear_out[n.name] = self.linear_out[x.name]

    def permute(self, n: fx.Node, shape: Any) -> None:
        x = n.args[0]
        lay = self.L(x)
        if lay is None:
            return self.opaque(n, _opname(n))
        nd = len(lay)
        op = _opname(n)
        order = list(range(nd))
        if op in ("transpose", "swapaxes"):
            i, j = (int(a) % nd for a in n.args[1:3])
            order[i], order[j] = order[j], order[i]
        elif op in ("t", "numpy_T", "mT"):
            order = order[::-1] if nd <= 2 or op != "mT" else [*order[:-2], nd - 1, nd - 2]
        elif op == "permute":
            order = [int(a) % nd for a in n.args[1]]
        elif op == "movedim":
            src, dst = int(n.args[1]) % nd, int(n.args[2]) % nd
            order.pop(src)
            order.insert(dst, src)
        self.lay[n.name] = [lay[i] for i in order]
        if x.name in self.src:
            p, amap = self.src[x.name]
            self.src[n.name] = (p, tuple(amap[i] for i in order))

    def op_getitem(self, n: fx.Node, shape: Any) -> None:
        x, idx = n.args[0], n.args[1]
        if isinstance(x, fx.Node) and x.name in self.routed and _opname(x) == "topk":
            if idx == 1:
                self.routed[n.name] = self.routed[x.name]  # the chosen experts, not their weights
        elif isinstance(x, fx.Node) and x.name in self.routed:
            self.routed[n.name] = self.routed[x.name]
        seq = self.lay.get(x.name) if isinstance(x, fx.Node) else None
        if isinstance(idx, int) and isinstance(seq, list) and seq and isinstance(seq[0], list):
            self.lay[n.name] = seq[idx]
            self.feature[n.name] = self.feat(x)
            if x.name in self.pieces_of:
                self.linear_piece[n.name] = (self.pieces_of[x.name][0], idx)
            return None
        if shape is not None:
            self.lay[n.name] = self.fresh_layouts(shape)

    def _dim(self, n: fx.Node, pos: int, default: int, nd: int) -> int:
        d = n.args[pos] if len(n.args) > pos else n.kwargs.get("dim", default)
        return int(d) % nd

    def op_slice(self, n: fx.Node, shape: Any) -> None:
        x = n.args[0]
        lay = self.L(x)
        xs = _shape(x)
        if lay is None or xs is None or shape is None:
            return self.opaque(n, "slice")
        dim = self._dim(n, 1, 0, len(lay))
        start = n.args[2] if len(n.args) > 2 and n.args[2] is not None else 0
        end = n.args[3] if len(n.args) > 3 and n.args[3] is not None else xs[dim]
        step = n.args[4] if len(n.args) > 4 else 1
        start, end = int(start), min(int(end), xs[dim])
        start = start + xs[dim] if start < 0 else start
        end = end + xs[dim] if end < 0 else end
        out = list(lay)
        if (start, end, step) == (0, xs[dim], 1):
            pass
        elif step == 2 and start in (0, 1) and end >= xs[dim] - 1 and len(lay[dim]) == 1 and xs[dim] % 2 == 0:
            out[dim] = (self.ax.every_other(lay[dim][0], start),)  # x[..., 0::2], x[..., 1::2]
        elif step == 1 and self._outer_piece(lay, dim, start, end) is not None:
            out = self._outer_piece(lay, dim, start, end)
        elif step != 1 or len(lay[dim]) != 1:
            if self.feat(x):
                self.ax.tag(lay[dim], "opaque:slice")
            out[dim] = (self.ax.fresh(shape[dim], "opaque:slice"),) if shape[dim] > 1 else ()
        else:
            out[dim] = (self.ax.seg(lay[dim][0], start, end),) if end > start else ()
        self.lay[n.name] = out
        if x.name in self.src and out[dim] == lay[dim]:
            self.src[n.name] = self.src[x.name]

    def _pieces(self, n: fx.Node, sizes: list[int], dim: int) -> None:
        x = n.args[0]
        lay = self.L(x)
        if lay is None:
            return self.opaque(n, _opname(n))
        if isinstance(x, fx.Node) and x.name in self.linear_out and dim == len(lay) - 1:
            self.pieces_of[n.name] = (self.linear_out[x.name], len(sizes))  # a fused gate/up split in two
        out, pos = [], 0
        for s in sizes:
            piece = list(lay)
            outer = self._outer_piece(lay, dim, pos, pos + s) if s > 0 else None
            if outer is not None:
                piece = outer
            elif len(lay[dim]) == 1:
                piece[dim] = (self.ax.seg(lay[dim][0], pos, pos + s),) if s > 0 else ()
            elif lay[dim]:
                self.ax.tag(lay[dim], "opaque:split")
                piece[dim] = (self.ax.fresh(s, "opaque:split"),) if s > 1 else ()
            out.append(piece)
            pos += s
        self.lay[n.name] = out

    def op_split(self, n: fx.Node, shape: Any) -> None:
        xs = _shape(n.args[0])
        size = n.args[1]
        dim = self._dim(n, 2, 0, len(xs or ()))
        if isinstance(size, int):
            sizes = [min(size, xs[dim] - p) for p in range(0, xs[dim], size)]
        else:
            sizes = [int(s) for s in size]
        return self._pieces(n, sizes, dim)

    op_split_with_sizes = op_split

    def op_chunk(self, n: fx.Node, shape: Any) -> None:
        xs = _shape(n.args[0])
        dim = self._dim(n, 2, 0, len(xs or ()))
        k = int(n.args[1])
        size = -(-xs[dim] // k)
        return self._pieces(n, [min(size, xs[dim] - p) for p in range(0, xs[dim], size)], dim)

    def op_unbind(self, n: fx.Node, shape: Any) -> None:
        x = n.args[0]
        lay = self.L(x)
        if lay is None:
            return self.opaque(n, "unbind")
        dim = self._dim(n, 1, 0, len(lay))
        self.lay[n.name] = [self._select(lay, dim, i) for i in range(_shape(x)[dim])]

    def op_select(self, n: fx.Node, shape: Any) -> None:
        x = n.args[0]
        lay = self.L(x)
        if lay is None:
            return self.opaque(n, "select")
        dim = self._dim(n, 1, 0, len(lay))
        idx = int(n.args[2]) % _shape(x)[dim]
        self.lay[n.name] = self._select(lay, dim, idx)

    def _select(self, lay: list[Layout], dim: int, idx: int) -> list[Layout]:
        """Index ``idx`` of dim ``dim`` (the dim goes away)."""
        piece = self._outer_piece(lay, dim, idx, idx + 1)
        if piece is None:
            return lay[:dim] + lay[dim + 1 :]
        return piece[:dim] + piece[dim + 1 :]

    def _outer_piece(self, lay: list[Layout], dim: int, start: int, end: int) -> list[Layout] | None:
        """Positions [start, end) of dim ``dim`` when that dim is the outer factor of a
        product split (timm's qkv: (3, H, dh); Falcon's fused heads: (H + 2, dh)): the
        piece is a segment of the split atom, with inner classes of its own (q, k and v
        do not share a head width class). None when the dim is no such factor."""
        if len(lay[dim]) != 1:
            return None
        a = lay[dim][0]
        org = self.ax.origin.get(a)
        if org is None or org[1] != "split" or org[2][1] != 0:
            return None
        parent, _, (sizes, _) = org
        inner = tuple(sizes[1:])
        width = 1
        for z in inner:
            width *= z
        seg = self.ax.seg(parent, start * width, end * width)
        old = self.ax.split(parent, sizes)[1:]
        if end - start > 1:
            new = self.ax.split(seg, (end - start, *inner))
            outer, new = new[0], new[1:]
        else:
            outer = None
            new = self.ax.split(seg, inner) if len(inner) > 1 else (seg,)
        remap: dict[int, int] = {}
        for o, m in zip(old, new):
            self._mirror(o, m, remap)
        out = [tuple(remap.get(self.ax.find(x), x) for x in d) for d in lay]
        out[dim] = (outer,) if outer is not None else ()
        return out

    def _mirror(self, old: int, new: int, remap: dict[int, int]) -> None:
        """Map ``old`` and the pieces it was split into onto ``new``'s same pieces."""
        r = self.ax.find(old)
        if r in remap:
            return
        remap[r] = new
        for sizes, kids in list(self.ax.splits.get(r, {}).items()):
            for k, m in zip(kids, self.ax.split(new, sizes)):
                self._mirror(k, m, remap)

    def op_cat(self, n: fx.Node, shape: Any) -> None:
        xs = [x for x in n.args[0]]
        lays = [self.L(x) for x in xs]
        if shape is None or any(lay is None for lay in lays):
            return self.opaque(n, "cat")
        nd = len(shape)
        dim = (int(n.args[1]) if len(n.args) > 1 else int(n.kwargs.get("dim", 0))) % nd
        out = [None] * nd
        for j in range(nd):
            if j == dim:
                continue
            for lay in lays:
                if lay[j] and shape[j] > 1:
                    if out[j] is None:
                        out[j] = lay[j]
                    else:
                        self.ax.unify_layouts(out[j], lay[j])
        whole = self.ax.fresh(shape[dim]) if shape[dim] > 1 else None
        pos = 0
        for x, lay in zip(xs, lays):
            s = _shape(x)[dim]
            if whole is not None and s > 0:
                piece = self.ax.seg(whole, pos, pos + s)
                if lay[dim]:
                    self.ax.unify_layouts((piece,), lay[dim])
            if x.name in self.src:  # a class token or register token joining the features
                for j in range(nd):
                    if j != dim:
                        self.role(x, j, "co", n)
            pos += s
        out[dim] = (whole,) if whole is not None else ()
        self.lay[n.name] = [o if o is not None else ((self.ax.fresh(s),) if s > 1 else ()) for o, s in zip(out, shape)]

    op_concat = op_cat

    def op_stack(self, n: fx.Node, shape: Any) -> None:
        """Tensors stacked along a new dim move together on every other dim."""
        xs = list(n.args[0])
        lays = [self.L(x) for x in xs]
        if shape is None or any(lay is None for lay in lays) or len({len(lay) for lay in lays}) != 1:
            return self.opaque(n, "stack")
        nd = len(shape)
        dim = (int(n.args[1]) if len(n.args) > 1 else int(n.kwargs.get("dim", 0))) % nd
        base = list(lays[0])
        for lay in lays[1:]:
            for j, d in enumerate(lay):
                if base[j] and d:
                    self.ax.unify_layouts(base[j], d)
        new = (self.ax.fresh(shape[dim]),) if shape[dim] > 1 else ()
        self.lay[n.name] = [*base[:dim], new, *base[dim:]]

    # -- arithmetic --------------------------------------------------------------------
    def op_add(self, n: fx.Node, shape: Any) -> None:
        return self._addsub(n, shape, "add")

    def op_sub(self, n: fx.Node, shape: Any) -> None:
        return self._addsub(n, shape, "sub")

    def op_rsub(self, n: fx.Node, shape: Any) -> None:
        return self._addsub(n, shape, "sub")

    def _addsub(self, n: fx.Node, shape: Any, op: str) -> None:
        if shape is None:
            return self.opaque(n, op)
        a, b = n.args[0], n.args[1]
        tensors = [x for x in (a, b) if isinstance(x, fx.Node) and self.L(x) is not None]
        feats = [x for x in tensors if self.feat(x)]
        # a parameter plus a constant: Gemma's (1 + weight)
        if len(tensors) == 1 and tensors[0].name in self.gainlike:
            other = b if tensors[0] is a else a
            if isinstance(other, (int, float)):
                p, off = self.gainlike[tensors[0].name]
                self.gainlike[n.name] = (p, off + float(other))
                self.lay[n.name] = list(self.L(tensors[0]))
                if tensors[0].name in self.src:
                    self.src[n.name] = self.src[tensors[0].name]
                return None
        if len(feats) == 2 or (len(feats) == 1 and len(tensors) == 1):
            self.lay[n.name] = self.broadcast(shape, feats)
            if len(tensors) == 1 and not isinstance(a if tensors[0] is b else b, fx.Node):
                other = a if tensors[0] is b else b
                if other != 0 and tensors[0].name not in self.gainlike and tensors[0].name not in self.src:  # x + c: moves the all-ones direction
                    self.ax.tag([x for d in self.lay[n.name][-1:] for x in d], "shift")
            for x in feats:  # biases and position tables added to features (role() skips activations)
                shape_x = _shape(x) or ()
                for j in range(len(shape_x)):
                    self.role(x, j - len(shape_x), "co", n)
            return None
        if len(feats) == 1:  # a feature tensor plus a table that is not one (a mask, a fixed position table)
            f = feats[0]
            self.lay[n.name] = self.broadcast(shape, [f])
            self._tag_along(n, shape, b if f is a else a, "constadd")
            return None
        self.lay[n.name] = self.broadcast(shape, tensors, unify=False)

    def _tag_along(self, n: fx.Node, shape: Any, table: Any, tag: str) -> None:
        """Tag the classes of ``n``'s dims along which ``table`` (a tensor that is no
        feature: a mask, a position table) varies."""
        lay = self.L(table) or []
        off = len(shape) - len(lay)
        for i, d in enumerate(lay):
            if d and shape[off + i] > 1:
                self.ax.tag(self.lay[n.name][off + i], tag)

    def op_mul(self, n: fx.Node, shape: Any) -> None:
        return self._muldiv(n, shape, "mul")

    def op_div(self, n: fx.Node, shape: Any) -> None:
        return self._muldiv(n, shape, "div")

    def _muldiv(self, n: fx.Node, shape: Any, op: str) -> None:
        if shape is None:
            return self.opaque(n, op)
        a, b = n.args[0], n.args[1]
        tensors = [x for x in (a, b) if isinstance(x, fx.Node) and self.L(x) is not None]
        if len(tensors) == 1:  # by a scalar
            x = tensors[0]
            self.lay[n.name] = list(self.L(x)) if len(self.L(x)) == len(shape) else self.broadcast(shape, [x])
            for d in (self.src, self.gainlike, self.linear_out):
                if x.name in d and op == "mul":
                    d[n.name] = d[x.name]
            return None
        # a gain: a feature tensor times a parameter vector (or 1 + parameter) along its last axis
        for g, x in ((a, b), (b, a)):
            if op == "mul" and isinstance(g, fx.Node) and g.name in self.gainlike and self.feat(x) and g is not x \
                    and x.name not in self.gainlike and (_shape(g) or (0,))[-1] == shape[-1] and shape[-1] > 1:
                pname, off = self.gainlike[g.name]
                self.lay[n.name] = self.broadcast(shape, [x, g])
                self.role(g, -1, "gain", n, x)
                self.gain_at[n.name] = (pname, off, x.name)
                return None
        fa, fb = self.feat(a), self.feat(b)
        if fa and fb:
            out = self.broadcast(shape, [a, b])
            self.lay[n.name] = out
            la, lb = self.L(a), self.L(b)
            both = [j for j in range(len(shape)) if shape[j] > 1 and (len(shape) - j) <= len(la) and (len(shape) - j) <= len(lb)
                    and la[len(la) - len(shape) + j] and lb[len(lb) - len(shape) + j]]
            self.ax.tag([x for j in both for x in out[j]], "product")
            # a per-position scalar (a norm's 1/rms) broadcast along the features is not a product of features
            for x, other in ((a, b), (b, a)):
                if op != "mul" or (_shape(other) or (1,))[-1] != shape[-1]:
                    continue  # a per-row weight (a router's probability) scales rows, not units
                if x.name in self.linear_out and other.name not in self.linear_out:
                    self.facts.gates.append((n.name, self.linear_out[x.name], other.name))
                elif x.name in self.linear_piece and other.name not in self.linear_piece and other.name not in self.linear_out:
                    weight, piece = self.linear_piece[x.name]
                    self.facts.gates.append((n.name, weight, other.name, piece, x.name))
            return None
        f = a if fa else b if fb else None
        if f is None:
            self.lay[n.name] = self.broadcast(shape, tensors, unify=False)
            return None
        self.lay[n.name] = self.broadcast(shape, [f])
        self._tag_along(n, shape, b if f is a else a, "varying")  # a rotary table, a fixed mask
        if f.name in self.src and op == "mul":
            self.src[n.name] = self.src[f.name]

    # -- mixtures of experts -------------------------------------------------------------
    def op_topk(self, n: fx.Node, shape: Any) -> None:
        """Top-k over a router's scores: the experts it picks depend on the order of the
        scores only, so a permutation of the experts moves the picks with it; the values
        are the picked scores, in their own (sorted) order."""
        x = n.args[0]
        lay = self.L(x)
        val = _val(n)
        if lay is None or not isinstance(val, (tuple, list)) or len(val) != 2:
            return self.opaque(n, "topk")
        dim = self._dim(n, 2, -1, len(lay))
        self.ax.tag(lay[dim], "topk")
        k = int(val[0].shape[dim])
        out = list(lay)
        out[dim] = (self.ax.fresh(k),) if k > 1 else ()
        self.lay[n.name] = [out, [d if i != dim else ((self.ax.fresh(k),) if k > 1 else ()) for i, d in enumerate(lay)]]
        self.feature[n.name] = self.feat(x)
        if lay[dim] and len(lay[dim]) == 1:
            self.routed[n.name] = (lay[dim][0], self._router_of(x))

    def _router_of(self, x: fx.Node) -> str | None:
        """The weight of the linear layer whose scores reach ``x`` through casts and a softmax."""
        cur = x
        for _ in range(8):
            if cur.name in self.linear_out:
                return self.linear_out[cur.name]
            if not cur.all_input_nodes:
                return None
            cur = cur.all_input_nodes[0]
        return None

    def op_index(self, n: fx.Node, shape: Any) -> None:
        """``x[idx]`` with one index tensor: rows gathered along one dim, every other dim
        as it was. The gathered dim is indexed by data (no symmetry may act on it); an
        expert weight indexed by routed experts is the experts' product (:meth:`op_bmm`)."""
        x, idx = n.args[0], n.args[1]
        lay = self.L(x)
        if lay is None or shape is None or not isinstance(idx, (list, tuple)):
            return self.opaque(n, "index")
        pos = [i for i, t in enumerate(idx) if t is not None]
        if len(pos) != 1 or not isinstance(idx[pos[0]], fx.Node):
            return self.opaque(n, "index")
        i, t = pos[0], idx[pos[0]]
        width = len(_shape(t) or ())
        if len(shape) != len(lay) - 1 + width:
            return self.opaque(n, "index")
        if i == 0 and x.name in self.src and len(lay) == 3:  # a stack of weights, one picked per row
            pname, amap = self.src[x.name]
            atom: int | None = None
            router = None
            if t.name in self.routed and lay[0] and len(lay[0]) == 1:
                atom, router = self.routed[t.name]
                self.ax.unify(lay[0][0], atom)
                self.role(x, 0, "expert")
            elif lay[0]:
                self.ax.tag(lay[0], "gather")  # picked by something other than a router: no permutation
            self.expert_rows[n.name] = (pname, (None,) * width + tuple(amap[1:]), atom, router)
        elif self.feat(x) and lay[i]:
            self.ax.tag(lay[i], "gather")
        self.lay[n.name] = [*lay[:i], *self.fresh_layouts(shape[i : i + width]), *lay[i + 1 :]]

    def op_repeat_interleave(self, n: fx.Node, shape: Any) -> None:
        """Rows repeated (a token copied once per picked expert): the other dims as they were."""
        x = n.args[0] if n.args else None
        lay = self.L(x)
        dim = n.args[2] if len(n.args) > 2 else n.kwargs.get("dim")
        if lay is None or shape is None or dim is None or len(shape) != len(lay):
            return self.opaque(n, "repeat_interleave")
        dim = int(dim) % len(lay)
        if self.feat(x) and lay[dim]:
            self.ax.tag(lay[dim], "gather")
        self.lay[n.name] = [d if j != dim else ((self.ax.fresh(shape[j]),) if shape[j] > 1 else ()) for j, d in enumerate(lay)]

    def op_grouped_mm_fallback(self, n: fx.Node, shape: Any) -> None:
        """A grouped matmul (the experts of a mixture, rows sorted by expert): ``x`` [N, in]
        times the expert weights [E, in, out], the row groups given by routed offsets."""
        x, w = n.args[0], n.args[1]
        offs = n.args[2] if len(n.args) > 2 else n.kwargs.get("offs")
        lx, lw = self.L(x), self.L(w)
        if lx is None or lw is None or shape is None or len(lw) != 3 or len(lx) != 2 or w.name not in self.src \
                or not isinstance(offs, fx.Node) or offs.name not in self.routed:
            return self.opaque(n, _opname(n))
        atom, router = self.routed[offs.name]
        pname, amap = self.src[w.name]
        if lw[0] and len(lw[0]) == 1:
            self.ax.unify(lw[0][0], atom)
        self.ax.unify_layouts(lx[-1], lw[1])
        self.lay[n.name] = [lx[0], lw[2]]
        own = self.alias(pname)
        if amap[1] is None or amap[2] is None or amap[0] is None:
            return self.opaque(n, _opname(n))
        roles = self.facts.roles.setdefault(own, {})
        roles.setdefault(amap[1], set()).add("contra")
        roles.setdefault(amap[2], set()).add("co")
        roles.setdefault(amap[0], set()).add("expert")
        self.facts.experts.append(ExpertUse(own, amap[0], amap[1], amap[2], router, atom, x.name, n.name))
        self.linear_out[n.name] = own

    op__grouped_mm = op_grouped_mm_fallback

    def _gathered_expert_matmul(self, n: fx.Node, shape: Any, a: fx.Node, b: fx.Node) -> bool:
        """``W[idx] @ x`` [N, out, in] x [N, in, 1]: the experts' product (batched_mm)."""
        if a.name not in self.expert_rows:
            return False
        la, lb = self.L(a), self.L(b)
        if la is None or lb is None or shape is None or len(la) != 3 or len(lb) != 3:
            return False
        pname, amap, atom, router = self.expert_rows[a.name]
        self.ax.unify_layouts(la[-1], lb[-2])
        batch = self.broadcast(shape[:-2], [_Sub(a, la[:-2]), _Sub(b, lb[:-2])])
        self.lay[n.name] = [*list(batch), la[-2], lb[-1]]
        r_axis, w_axis = amap[-1], amap[-2]
        e_axis = next((i for i in range(len(self.facts.param_atoms.get(pname, []))) if i not in (r_axis, w_axis)), None)
        if r_axis is None or w_axis is None or e_axis is None:
            return False
        own = self.alias(pname)
        roles = self.facts.roles.setdefault(own, {})
        roles.setdefault(r_axis, set()).add("contra")
        roles.setdefault(w_axis, set()).add("co")
        if atom is None:  # not routed: a linear layer whose weight stack is indexed by data
            self.facts.linears.append(Linear(own, r_axis, w_axis, None, b.name, n.name))
        else:
            self.facts.experts.append(ExpertUse(own, e_axis, r_axis, w_axis, router, atom, b.name, n.name))
        self.linear_out[n.name] = own
        return True

    # -- nonlinear and reductions ------------------------------------------------------
    def elementwise(self, n: fx.Node, shape: Any, op: str) -> None:
        ins = [x for x in n.all_input_nodes if self.L(x) is not None and self.feat(x)]
        if shape is None:
            return self.opaque(n, op)
        if not ins:
            self.lay[n.name] = self.broadcast(shape, [x for x in n.all_input_nodes if self.L(x) is not None], unify=False)
            return None
        self.lay[n.name] = self.broadcast(shape, ins)
        tag = "homogeneous" if op in HOMOGENEOUS else f"odd:{op}" if op in ODD else f"nonlinear:{op}"
        atoms = [x for d in self.lay[n.name] for x in d]
        if op == "pow" and len(n.args) > 1 and n.args[1] == 2:
            self.squares.add(n.name)
            tag = "square"
        self.ax.tag(atoms, tag)
        if op in HOMOGENEOUS and ins and ins[0].name in self.linear_out:
            self.facts.homogeneous.append((n.name, self.linear_out[ins[0].name]))

    def reduce(self, n: fx.Node, shape: Any, op: str) -> None:
        x = n.args[0]
        lay = self.L(x)
        xs = _shape(x)
        if lay is None or xs is None:
            return self.opaque(n, op)
        dims = n.args[1] if len(n.args) > 1 else n.kwargs.get("dim")
        if dims is None:
            dims = list(range(len(xs)))
        dims = [int(d) % len(xs) for d in (dims if isinstance(dims, (list, tuple)) else [dims])]
        keep = bool(n.args[2]) if len(n.args) > 2 and isinstance(n.args[2], bool) else bool(n.kwargs.get("keepdim", False))
        if op in ("var", "std"):
            kind = "var"
        elif x.name in self.squares and op in ("mean", "sum"):
            kind = "sumsq"
        elif op in ("mean", "sum"):
            kind = "mean"
        elif op in ("norm", "linalg_vector_norm"):
            kind = "sumsq"
        else:
            kind = f"reduce:{op}"
        for d in dims:
            if self.feat(x):
                self.ax.tag(lay[d], kind)
        if shape is None:
            return None
        out = [lay[i] if i not in dims else () for i in range(len(xs))] if keep else [lay[i] for i in range(len(xs)) if i not in dims]
        self.lay[n.name] = out if len(out) == len(shape) else self.fresh_layouts(shape)

    def op__softmax(self, n: fx.Node, shape: Any) -> None:
        return self.op_softmax(n, shape)

    def op__safe_softmax(self, n: fx.Node, shape: Any) -> None:
        return self.op_softmax(n, shape)

    def op_softmax(self, n: fx.Node, shape: Any) -> None:
        x = n.args[0]
        lay = self.L(x)
        if lay is None:
            return self.opaque(n, "softmax")
        dim = self._dim(n, 1, -1, len(lay))
        self.ax.tag(lay[dim], "softmax")
        self.lay[n.name] = list(lay)

    # -- layers ------------------------------------------------------------------------
    def op_linear(self, n: fx.Node, shape: Any) -> None:
        x, w = n.args[0], n.args[1]
        b = n.args[2] if len(n.args) > 2 else n.kwargs.get("bias")
        return self._linear(n, shape, x, w, b, read=1, write=0)

    def op_addmm(self, n: fx.Node, shape: Any) -> None:
        b, x, w = n.args[0], n.args[1], n.args[2]
        return self._linear(n, shape, x, w, b, read=0, write=1)

    def op_mm(self, n: fx.Node, shape: Any) -> None:
        return self.op_matmul(n, shape)

    def op_bmm(self, n: fx.Node, shape: Any) -> None:
        return self.op_matmul(n, shape)

    def _linear(self, n: fx.Node, shape: Any, x: Any, w: Any, b: Any, read: int, write: int) -> None:
        lx, lw = self.L(x), self.L(w)
        if lx is None or lw is None or shape is None or len(lw) != 2:
            return self.opaque(n, "linear")
        self.ax.unify_layouts(lx[-1], lw[read])
        out = [*list(lx[:-1]), lw[write]]
        if len(out) != len(shape):
            out = [*self.ax.regroup(lx[:-1], shape[:-1]), lw[write]]
        bias = None
        if isinstance(b, fx.Node) and self.L(b) is not None:
            self.ax.unify_layouts(self.L(b)[-1], lw[write])
            self.role(b, -1, "co", n)
            bias = self.src.get(b.name, (None,))[0]
        self.role(w, read, "contra", x)
        self.role(w, write, "co", n)
        self.lay[n.name] = out
        if w.name in self.src:
            pname, amap = self.src[w.name]
            pname = self.alias(pname)
            self.facts.param_atoms.setdefault(pname, self.facts.param_atoms[self.src[w.name][0]])
            self.facts.linears.append(Linear(pname, amap[read], amap[write], bias, x.name, n.name))
            self.linear_out[n.name] = pname

    def op_matmul(self, n: fx.Node, shape: Any) -> None:
        a, b = n.args[0], n.args[1]
        la, lb = self.L(a), self.L(b)
        if la is None or lb is None or shape is None:
            return self.opaque(n, "matmul")
        if isinstance(a, fx.Node) and isinstance(b, fx.Node) and self._gathered_expert_matmul(n, shape, a, b):
            return None
        if b.name in self.src and len(lb) == 2:  # x @ W (a weight stored input-first)
            return self._linear(n, shape, a, b, None, read=0, write=1)
        if len(la) < 2 or len(lb) < 2:
            return self.opaque(n, "matmul")
        # a contraction of two activations: a's features with b's rows are a dual pair
        if la[-1] and lb[-2]:
            if len(la[-1]) == 1 and len(lb[-2]) == 1:
                self.ax.pairs.append((la[-1][0], lb[-2][0]))
            else:
                self.ax.unify_layouts(la[-1], lb[-2])
        batch = self.broadcast(shape[:-2], [_Sub(a, la[:-2]), _Sub(b, lb[:-2])]) if len(shape) > 2 else []
        self.lay[n.name] = [*list(batch), la[-2], lb[-1]]
        self._attention_from_matmul(n, a, b)

    def _attention_from_matmul(self, n: fx.Node, a: fx.Node, b: fx.Node) -> None:
        """q @ k^T -> (scale, mask, softmax, dropout) -> @ v: one attention."""
        la, lb = self.L(a), self.L(b)
        if len(la) < 3:
            return
        cur, seen_softmax = n, False
        for _ in range(12):
            users = [u for u in cur.users if _opname(u) not in NO_TENSOR]
            if len(users) != 1:
                return
            u = users[0]
            op = _opname(u)
            if op in ("matmul", "bmm") and u.args[0] is cur and seen_softmax:
                v = u.args[1]
                lv = self.L(v)
                if lv is None or len(lv) < 3:
                    return
                kh, kv = self._kv_source(b, (_shape(a) or (0, 0, 0))[-3])
                self.facts.attentions.append(Attention(la[-1], lb[-2], lv[-1], la[-3], kh if kv else lb[-3], u.name,
                                                       self.facts.modules.get(n.name, ""), kv))
                return
            seen_softmax |= op in ("softmax", "_softmax", "_safe_softmax")
            cur = u

    def op_scaled_dot_product_attention(self, n: fx.Node, shape: Any) -> None:
        q, k, v = n.args[0], n.args[1], n.args[2]
        lq, lk, lv = self.L(q), self.L(k), self.L(v)
        if lq is None or lk is None or lv is None or shape is None or len(lq) < 3:
            return self.opaque(n, "scaled_dot_product_attention")
        if lq[-1] and lk[-1]:
            self.ax.pairs.append((lq[-1][0], lk[-1][0])) if len(lq[-1]) == 1 and len(lk[-1]) == 1 else \
                self.ax.unify_layouts(lq[-1], lk[-1])
        self.ax.unify_layouts(lk[-2], lv[-2])  # key and value positions
        self.ax.unify_layouts(lk[-3], lv[-3])  # key and value heads
        qs, ks = _shape(q), _shape(k)
        if qs[-3] == ks[-3]:
            self.ax.unify_layouts(lq[-3], lk[-3])
        elif lq[-3] and lk[-3] and qs[-3] % ks[-3] == 0:  # enable_gqa: each kv head serves a group of query heads
            group = self.ax.split(lq[-3][0], (ks[-3], qs[-3] // ks[-3])) if len(lq[-3]) == 1 else lq[-3]
            self.ax.unify_layouts((group[0],), lk[-3])
        self.lay[n.name] = [*list(lq[:-1]), lv[-1]]
        kh, kv = self._kv_source(k, qs[-3])
        self.facts.attentions.append(Attention(lq[-1], lk[-1], lv[-1], lq[-3], kh, n.name, self.facts.modules.get(n.name, ""), kv))

    def _kv_source(self, k: fx.Node, heads: int) -> tuple[Layout, int]:
        """The key heads before a repeat for grouped-query attention (unsqueeze, expand,
        reshape): their layout and count (0 when there are as many as query heads)."""
        cur = k
        for _ in range(8):
            op = _opname(cur)
            last_two = op == "transpose" and len(cur.args) > 2 and all(int(d) % len(_shape(cur) or (0,)) >= len(_shape(cur) or (0,)) - 2 for d in cur.args[1:3])
            if not last_two and (op not in ("reshape", "view", "_unsafe_view", "expand", "unsqueeze", "clone", "contiguous", "alias") or not cur.args):
                break
            cur = cur.args[0]
        shape = _shape(cur)
        lay = self.L(cur)
        if shape is None or lay is None or len(shape) < 3 or shape[-3] >= heads:
            lk = self.L(k)
            return (lk[-3] if lk else ()), 0
        return lay[-3], shape[-3]

    def op_embedding(self, n: fx.Node, shape: Any) -> None:
        w, ids = n.args[0], n.args[1]
        lw, li = self.L(w), self.L(ids)
        if lw is None or li is None or len(lw) != 2:
            return self.opaque(n, "embedding")
        self.ax.tag(lw[0], "index")
        self.role(w, 0, "index")
        self.role(w, 1, "co", n)
        self.lay[n.name] = [*list(li), lw[1]]
        self.feature[n.name] = True

    def op_conv2d(self, n: fx.Node, shape: Any) -> None:
        x, w = n.args[0], n.args[1]
        b = n.args[2] if len(n.args) > 2 else None
        lx, lw = self.L(x), self.L(w)
        if lx is None or lw is None or shape is None or len(lw) != 4:
            return self.opaque(n, "conv2d")
        self.ax.unify_layouts(lx[-3], lw[1])
        self.ax.tag(lw[2] + lw[3], "kernel")
        self.role(w, 1, "contra", x)
        self.role(w, 0, "co", n)
        self.role(w, 2, "kernel")
        self.role(w, 3, "kernel")
        if isinstance(b, fx.Node) and self.L(b) is not None:
            self.ax.unify_layouts(self.L(b)[-1], lw[0])
            self.role(b, -1, "co", n)
        out = [((self.ax.fresh(s, "data"),) if s > 1 else ()) for s in shape]  # positions come from the input's
        out[-3] = lw[0]
        out[0] = lx[0] if lx[0] and shape[0] > 1 else out[0]
        self.lay[n.name] = out
        if w.name in self.src:
            self.facts.linears.append(Linear(self.src[w.name][0], 1, 0, self.src.get(getattr(b, "name", ""), (None,))[0], x.name, n.name))

    op_convolution = op_conv2d

    def op_layer_norm(self, n: fx.Node, shape: Any) -> None:
        return self._norm(n, shape, "layernorm")

    def op_rms_norm(self, n: fx.Node, shape: Any) -> None:
        return self._norm(n, shape, "rms")

    def _norm(self, n: fx.Node, shape: Any, kind: str) -> None:
        x = n.args[0]
        lx = self.L(x)
        if lx is None:
            return self.opaque(n, kind)
        w = n.args[2] if len(n.args) > 2 else n.kwargs.get("weight")
        b = n.args[3] if kind == "layernorm" and len(n.args) > 3 else n.kwargs.get("bias")
        self.ax.tag(lx[-1], kind)
        gain = bias = None
        if isinstance(w, fx.Node) and self.L(w) is not None:
            self.ax.unify_layouts(self.L(w)[-1], lx[-1])
            self.role(w, -1, "gain", n, x)
            gain = self.gainlike.get(w.name, (None, 0.0))
        if isinstance(b, fx.Node) and self.L(b) is not None:
            self.ax.unify_layouts(self.L(b)[-1], lx[-1])
            self.role(b, -1, "normbias", n)
            bias = self.src.get(b.name, (None,))[0]
        self.lay[n.name] = list(lx)
        atom = lx[-1][0] if lx[-1] else self.ax.fresh(1)
        self.facts.norms.append(Norm(kind, gain[0] if gain else None, gain[1] if gain else 0.0, bias, atom, n.name,
                                     self.facts.modules.get(n.name, "")))

    op_native_layer_norm = op_layer_norm


class _Sub:
    """A view of a node with only some of its dims (the batch dims of a matmul)."""

    def __init__(self, node: fx.Node, lay: list[Layout]) -> None:
        self.node = node
        self.lay = lay


def read_graph(ep: Any, model: torch.nn.Module) -> Facts:
    """The facts of an exported program (see the module)."""
    r = _Reader(ep, model)
    facts = r.run()
    facts.nodes = {n.name: n for n in ep.graph.nodes}
    _manual_norms(r, facts)
    _consumers(r, facts)
    return facts


def _manual_norms(r: _Reader, facts: Facts) -> None:
    """Norms written by hand (x * rsqrt(mean(x^2) + eps) * gain): a gain applied to a class
    that an RMS or LayerNorm reduction normalises."""
    for node, (pname, off, xname) in r.gain_at.items():
        lay = r.L(_node(r, xname))
        if not lay or not lay[-1]:
            continue
        tags = r.ax.tags_of(lay[-1][0])
        kind = "rms" if "sumsq" in tags and "mean" not in tags else "layernorm" if "var" in tags or "mean" in tags else None
        if kind is None:
            continue
        bias = None
        n = _node(r, node)
        users = list(n.users)
        if len(users) == 1 and _opname(users[0]) == "add":
            other = [a for a in users[0].args if isinstance(a, fx.Node) and a is not n]
            if other and other[0].name in r.src and len(_shape(other[0]) or ()) == 1:
                bias = r.src[other[0].name][0]
                node = users[0].name
        facts.norms.append(Norm(kind, pname, off, bias, lay[-1][0], node, facts.modules.get(node, "")))


def _node(r: _Reader, name: str) -> fx.Node:
    return r.facts.nodes[name]


def _keeps_last(u: fx.Node) -> bool:
    """Does ``u`` (select, slice, mean) leave the last axis of its input whole?"""
    xs = _shape(u.args[0])
    if xs is None or len(u.args) < 2:
        return False
    dims = u.args[1] if isinstance(u.args[1], (list, tuple)) else [u.args[1]]
    if not all(isinstance(d, int) for d in dims):
        return False
    return not any(int(d) % len(xs) == len(xs) - 1 for d in dims)


def _rows_only(u: fx.Node) -> bool:
    """Does ``u`` gather or repeat rows (dim 0) of a matrix, or add a trailing unit dim,
    leaving the features as they are?"""
    op = _opname(u)
    xs = _shape(u.args[0])
    if xs is None or len(xs) != 2:
        return False
    if op == "index":
        idx = u.args[1]
        return isinstance(idx, (list, tuple)) and len(idx) >= 1 and idx[0] is not None and all(t is None for t in idx[1:])
    if op == "repeat_interleave":
        dim = u.args[2] if len(u.args) > 2 else u.kwargs.get("dim")
        return dim is not None and int(dim) % 2 == 0
    return op == "unsqueeze" and len(u.args) > 1 and int(u.args[1]) in (-1, 2)


def _consumers(r: _Reader, facts: Facts) -> None:
    """For every norm output: who reads it, after ops that only copy or reshape it. A
    ``("linear", weight, axis)`` entry is a layer reading it through that weight axis;
    anything else is ``(op, "", -1)``."""
    by_input: dict[str, list[Any]] = {}
    for lin in [*facts.linears, *facts.experts]:
        by_input.setdefault(lin.input, []).append(lin)
    for norm in facts.norms:
        out: list[tuple[str, str, int]] = []
        todo = [_node(r, norm.output)]
        seen = set()
        while todo:
            n = todo.pop()
            if n.name in seen:
                continue
            seen.add(n.name)
            for u in n.users:
                op = _opname(u)
                lins = [lin for lin in by_input.get(n.name, []) if lin.output == u.name]
                if lins:
                    out += [("linear", lin.weight, lin.read_axis) for lin in lins]
                elif op in TRANSPARENT or op in ("view", "reshape", "_unsafe_view", "alias") or (op in ("select", "slice", "mean") and _keeps_last(u)):
                    todo.append(u)
                elif op in ("index", "repeat_interleave", "unsqueeze") and _rows_only(u):
                    todo.append(u)  # rows gathered or repeated for the experts that read them
                elif op == "output":
                    out.append(("output", "", -1))
                else:
                    out.append((op, "", -1))
        facts.consumers[norm.output] = out
