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

from collections.abc import Sequence
from typing import Any

import torch
import torch.fx as fx

from .axes import Axes, Layout
from .facts import (
    HOMOGENEOUS,
    NO_TENSOR,
    NONLINEAR,
    PERMUTE,
    REDUCE,
    RESHAPE,
    TRANSPARENT,
    Attention,
    ExpertUse,
    Facts,
    Linear,
    Norm,
    Sub,
    is_integral,
    opname,
    shape_of,
    unreadable,
    val_of,
)
from .walk_layers import LayerRules
from .walk_shapes import ShapeRules

__all__ = ["Attention", "ExpertUse", "Facts", "Linear", "Norm", "read_graph"]


class Reader(ShapeRules, LayerRules):
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
        shape = shape_of(n)
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
            lay = x.lay if isinstance(x, Sub) else self.L(x)
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
            except Exception as e:  # a rule that did not fit this node: opaque, never wrong, and said why
                self.facts.unreadable[n.name] = unreadable(n, e)
                self.opaque(n, f"{opname(n)} ({type(e).__name__}: {' '.join(str(e).split())[:120]})")
        self.ax.close()
        for name, lay in self.lay.items():
            if isinstance(lay, list) and lay and isinstance(lay[-1], tuple) and len(lay[-1]) == 1:
                self.facts.node_atom[name] = lay[-1][0]
        return self.facts

    def node(self, n: fx.Node) -> None:
        op = opname(n)
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
        shape = shape_of(n)
        inputs = n.all_input_nodes
        # integer results (indices, counts, masks) are no features, whatever they came from
        self.feature[n.name] = any(self.feat(a) for a in inputs) and not is_integral(val_of(n))
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
        shape = shape_of(n)
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
        v = val_of(n)
        data = pname is None and n.name not in self.consts
        floating = isinstance(v, torch.Tensor) and v.is_floating_point() and data
        # a model input is data; a floating-point buffer or constant is a table the spec cannot move
        tags = ("data",) if data else ("buffer",) if isinstance(v, torch.Tensor) and v.is_floating_point() else ()
        self.lay[n.name] = self.fresh_layouts(shape, *tags)
        self.feature[n.name] = floating



def read_graph(ep: Any, model: torch.nn.Module) -> Facts:
    """The facts of an exported program (see the module)."""
    r = Reader(ep, model)
    facts = r.run()
    facts.nodes = {n.name: n for n in ep.graph.nodes}
    _manual_norms(r, facts)
    _consumers(r, facts)
    return facts


def _manual_norms(r: Reader, facts: Facts) -> None:
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
        if len(users) == 1 and opname(users[0]) == "add":
            other = [a for a in users[0].args if isinstance(a, fx.Node) and a is not n]
            if other and other[0].name in r.src and len(shape_of(other[0]) or ()) == 1:
                bias = r.src[other[0].name][0]
                node = users[0].name
        facts.norms.append(Norm(kind, pname, off, bias, lay[-1][0], node, facts.modules.get(node, "")))


def _node(r: Reader, name: str) -> fx.Node:
    return r.facts.nodes[name]


def _keeps_last(u: fx.Node) -> bool:
    """Does ``u`` (select, slice, mean) leave the last axis of its input whole?"""
    xs = shape_of(u.args[0])
    if xs is None or len(u.args) < 2:
        return False
    dims = u.args[1] if isinstance(u.args[1], (list, tuple)) else [u.args[1]]
    if not all(isinstance(d, int) for d in dims):
        return False
    return not any(int(d) % len(xs) == len(xs) - 1 for d in dims)


def _index_keeps_last(u: fx.Node) -> bool:
    """Does ``u`` (``x[i0, i1, ...]``) index only dims before the last one of a tensor of
    three or more dims (CLIP's pooled token: ``h[arange(B), ids.argmax(-1)]``)?"""
    xs = shape_of(u.args[0])
    idx = u.args[1] if len(u.args) > 1 else None
    return (xs is not None and len(xs) >= 3 and isinstance(idx, (list, tuple))
            and len(idx) < len(xs) and any(t is not None for t in idx))


def _rows_only(u: fx.Node) -> bool:
    """Does ``u`` gather or repeat rows (dim 0) of a matrix, or add a trailing unit dim,
    leaving the features as they are?"""
    op = opname(u)
    xs = shape_of(u.args[0])
    if xs is None or len(xs) != 2:
        return False
    if op == "index":
        idx = u.args[1]
        return isinstance(idx, (list, tuple)) and len(idx) >= 1 and idx[0] is not None and all(t is None for t in idx[1:])
    if op == "repeat_interleave":
        dim = u.args[2] if len(u.args) > 2 else u.kwargs.get("dim")
        return dim is not None and int(dim) % 2 == 0
    return op == "unsqueeze" and len(u.args) > 1 and int(u.args[1]) in (-1, 2)


def _consumers(r: Reader, facts: Facts) -> None:
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
                op = opname(u)
                lins = [lin for lin in by_input.get(n.name, []) if lin.output == u.name]
                if lins:
                    out += [("linear", lin.weight, lin.read_axis) for lin in lins]
                elif op in TRANSPARENT or op in ("view", "reshape", "_unsafe_view", "alias") or (op in ("select", "slice", "mean") and _keeps_last(u)):
                    todo.append(u)
                elif (op in ("index", "repeat_interleave", "unsqueeze") and _rows_only(u)) or (op == "index" and _index_keeps_last(u)):
                    todo.append(u)  # rows gathered or repeated for the experts that read them
                elif op == "output":
                    out.append(("output", "", -1))
                else:
                    out.append((op, "", -1))
        facts.consumers[norm.output] = out
