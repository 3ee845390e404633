"""From the graph's facts to a spec draft: spaces, bindings, canonicalisation, dims.

A :class:`Draft` is mutable: the verification (:mod:`.api`) shrinks a space's group when
its check fails and renders the draft again. Bindings are kept as structure (a chain of
factors, or a concatenation of chains) so that a space shrunk to the identity simply
disappears from every axis that named it.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

import attrs
import torch

from ..spec.model import AxisExpr, Chain, Term
from .lattice import SHRINK, largest, meet
from .walk import Facts

_LAYER = re.compile(r"\.(\d+)\.")


def term(space: str, index: int | None, path: str = "", dual: bool = False, absval: bool = False) -> Term:
    """A space acting on an axis, as the spec writes it: ``index`` is the layer (None for
    a global space), ``path`` a representation (``"qk"``, ``"ov.kv"``)."""
    return Term(space, index, tuple(path.split(".")) if path else (), "abs" if absval else "contra" if dual else "co")


def axis_expr(chains: list[list[Term]], cat: bool = False, heads: str | None = None) -> AxisExpr:
    """One parameter axis: a chain of terms, or a concatenation of chains (an empty chain:
    nothing acts there)."""
    return AxisExpr(tuple(Chain(tuple(c)) for c in chains), cat, heads)


#: an axis nothing acts on
UNTOUCHED = axis_expr([[]])


@attrs.define
class Space:
    base: str
    kind: str  # plain | heads | scale | sign
    group: str
    dim: str
    size: int
    instances: set[int | None] = attrs.field(factory=set)
    chain: list[str] = attrs.field(factory=list)
    evidence: list[str] = attrs.field(factory=list)
    doc: str = ""
    # heads
    qk: str = "GL"
    ov: str = "GL"
    qk_chain: list[str] = attrs.field(factory=list)
    ov_chain: list[str] = attrs.field(factory=list)
    heads_dim: str = "H"
    kv_dim: str | None = None
    dh_dim: str = "dh"
    rot: int | None = None
    rot_dim: str | None = None
    rope_layout: str = "half"
    # experts: Experts(experts_dim, within(dim))
    within: str = "S"
    experts_dim: str = "E"
    #: how it shrank: (from, to, why)
    history: list[tuple[str, str, str]] = attrs.field(factory=list)

    def group_text(self) -> str:
        if self.kind == "heads":
            rope = self.qk == "RoPE"
            qk = (f"{self.qk}({self.dh_dim}" + (f", rot={self.rot_dim}" if rope and self.rot_dim else "")
                  + (", layout=interleaved" if rope and self.rope_layout == "interleaved" else "") + ")")
            kv = f", kv={self.kv_dim}" if self.kv_dim else ""
            return f"Heads({self.heads_dim}, qk={qk}, ov={self.ov}({self.dh_dim}){kv})"
        if self.kind == "experts":
            return f"Experts({self.experts_dim}, {self.within}({self.dim}))"
        return f"{self.group}({self.dim})"

    @property
    def alive(self) -> bool:
        return self.group != "Id"

    def key(self) -> str:
        return f"{self.base}[i]" if None not in self.instances else self.base


@attrs.define
class Fold:
    gain: str | None
    bias: str | None
    offset: float
    into: list[tuple[str, int, str | None]]
    fold_bias: bool


@attrs.define
class Draft:
    name: str
    model_class: str
    dims: dict[str, tuple[str, int, str]]  # symbol -> (expression, value, comment)
    spaces: dict[str, Space]
    params: dict[str, list[AxisExpr] | str]  # name -> axes, or "invariant"
    param_notes: dict[str, str]
    ties: list[tuple[str, str]]
    untie: list[str]
    folds: list[Fold]
    center: dict[str, int]
    notes: list[str]
    #: what was not explained: (what, why)
    unexplained: list[tuple[str, str]]
    #: parameter -> the stored axes each bound axis sees (``view:``), for merged expert axes
    views: dict[str, tuple[tuple[int, ...], ...]] = attrs.field(factory=dict)


# -- building ---------------------------------------------------------------------------


def build(facts: Facts, model: torch.nn.Module, name: str, *, fold: bool = True, center: bool = True) -> Draft:
    return _Builder(facts, model, name, fold=fold, center=center).build()


def layer_of(pname: str) -> int | None:
    m = _LAYER.search(pname)
    return int(m.group(1)) if m else None


class _Builder:
    def __init__(self, facts: Facts, model: torch.nn.Module, name: str, *, fold: bool, center: bool) -> None:
        self.f = facts
        self.ax = facts.axes
        self.model = model
        self.name = name
        self.fold_ok = fold
        self.center_ok = center
        self.tensors = dict(model.named_parameters(remove_duplicate=False))
        self.spaces: dict[str, Space] = {}
        self.class_space: dict[int, tuple[str, int | None]] = {}  # class root -> (base, index)
        self.head_of: dict[int, tuple[str, int | None, bool]] = {}  # head class -> (base, index, kv view)
        self.within_of: dict[int, tuple[str, int | None, str, bool]] = {}  # within-head class -> (base, index, part, dual side)
        self.notes: list[str] = []
        self.unexplained: list[tuple[str, str]] = []
        self.dims: dict[str, tuple[str, int, str]] = {}
        self.single_kv: set[str] = set()  # attentions with one key/value head (multi-query)
        self.rope_layout = "half"
        self.router_of: dict[int, tuple[str, int | None]] = {}  # router output class -> (base, index)
        #: expert weight -> (view, unit axis, resid axis, pieces, base, index)
        self.expert_params: dict[str, tuple[tuple[tuple[int, ...], ...], int, int, int, str, int | None]] = {}
        self.expert_classes: set[int] = set()
        self.views: dict[str, tuple[tuple[int, ...], ...]] = {}

    # -- tags ------------------------------------------------------------------------
    def related_tags(self, atom: int) -> set[str]:
        """Tags of a class, of every class its refinements reach, and of the classes it
        is a piece of."""
        out: set[str] = set()
        for r in self.ax.descendants(atom):
            out |= self.ax.tags_of(r)
        a = self.ax.find(atom)
        seen = set()
        while a in self.ax.origin and a not in seen:
            seen.add(a)
            a = self.ax.find(self.ax.origin[a][0])
            out |= self.ax.tags_of(a)
        # a child's origin is recorded on the child atom, which may not be its class's root
        for child, (parent, _, _) in self.ax.origin.items():
            if self.ax.find(child) == self.ax.find(atom):
                out |= self.ax.tags_of(parent)
        return out

    # -- the pieces ------------------------------------------------------------------
    def build(self) -> Draft:
        self.attention_spaces()
        experts = self.expert_groups()
        folds, folded_gains, folded_biases, unfoldable = self.plan_folds()
        self.plain_spaces(unfoldable)
        self.expert_spaces(experts)
        self.scales()
        params = self.bindings(folded_gains, folded_biases, unfoldable)
        ties, untie = self.plan_ties(folds)
        centre = self.plan_center(folds) if self.center_ok else {}
        self.name_dims()
        draft = Draft(self.name, type(self.model).__name__, self.dims, self.spaces, params, self.param_notes,
                      ties, untie, folds, centre, self.notes, self.unexplained, self.views)
        return draft

    # -- mixtures of experts -------------------------------------------------------------
    def expert_groups(self) -> list[dict[str, Any]]:
        """The mixtures of experts: per router, its output class (one per expert), the
        experts' unit class and how each expert weight binds. Their classes are set aside
        (they are not plain spaces); what does not fit the pattern is left to the rest."""
        by_atom: dict[int, list[Any]] = {}
        for use in self.f.experts:
            by_atom.setdefault(self.ax.find(use.expert_atom), []).append(use)
        out = []
        for e_root, uses in by_atom.items():
            router = next((u.router for u in uses if u.router), None)
            r_atoms = self.f.param_atoms.get(router or "")
            if router is None or r_atoms is None or len(r_atoms) != 2 or self.ax.find(r_atoms[0]) != e_root:
                self.notes.append(f"experts {', '.join(sorted({u.weight for u in uses}))}: no router found whose scores pick them; left invariant")
                continue
            resid = self.ax.find(r_atoms[1])
            units: set[int] = set()
            binds = []
            for u in uses:
                atoms = self.f.param_atoms[u.weight]
                unit_axis = u.write_axis if self.ax.find(atoms[u.write_axis]) != resid else u.read_axis
                other = u.read_axis if unit_axis == u.write_axis else u.write_axis
                cls = self.ax.find(atoms[unit_axis])
                tiles = self.ax.tiling(cls)
                pieces = [self.ax.find(c) for _, _, c in tiles] if tiles else [cls]
                if self.ax.find(atoms[other]) != resid or len(atoms) != 3:
                    units.clear()
                    break
                units.update(pieces)
                binds.append((u, unit_axis, other, len(pieces)))
            if len(units) != 1:
                self.notes.append(f"experts of {router}: their hidden units do not form one class; left invariant")
                continue
            unit = units.pop()
            self.expert_classes |= {e_root, unit}
            out.append({"router": router, "experts": e_root, "unit": unit, "binds": binds})
        return out

    def expert_spaces(self, groups: list[dict[str, Any]]) -> None:
        for grp in groups:
            router, unit = grp["router"], grp["unit"]
            layer = layer_of(router)
            tags = self.related_tags(unit)
            g, why = largest(tags)
            within = meet(g, "SP")
            n_exp, f = self.ax.size[grp["experts"]], self.ax.size[unit]
            base = "moe"
            sp = self.spaces.get(base)
            if sp is None:
                dim = "f" if "f" not in self.dims or self.dims["f"][1] == f else "fe"
                sp = self.spaces[base] = Space(base, "experts", "Experts", dim, f, within=within, chain=["Id"] if within != "Id" else [])
                weights = sorted({u.weight for u, *_ in grp["binds"]})
                sp.evidence.append(f"{router}: a router (softmax, top-k) picks experts among {n_exp}; {', '.join(weights)}: "
                                   f"expert weights applied to the rows routed to each expert, so the experts may be "
                                   f"permuted with the router's rows")
                sp.evidence.append(f"each expert's {f} hidden units: " + (", ".join(why) if why else "only linear maps act on them"))
                self.dims.setdefault("E", ("", n_exp, "experts"))
                self.dims.setdefault(dim, ("", f, ""))
            sp.instances.add(layer)
            self.router_of[grp["experts"]] = (base, layer)
            for u, unit_axis, other, pieces in grp["binds"]:
                merged = (u.expert_axis, unit_axis)
                view = (merged, (other,)) if unit_axis < other else ((other,), merged)
                self.expert_params[u.weight] = (view, unit_axis, other, pieces, base, layer)
                self.views[u.weight] = view

    def attention_spaces(self) -> None:
        count: dict[int | None, int] = {}
        for att in self.f.attentions:
            if not (att.q and att.k and att.v and att.qh):
                continue
            qw, kw, vw = (self.ax.find(x[0]) for x in (att.q, att.k, att.v))
            qh = self.ax.find(att.qh[0])
            kh = self.ax.find(att.kh[0]) if att.kh else None
            layer = self._layer_of_module(att.module)
            k = count.get(layer, 0)
            count[layer] = k + 1
            base = "attn" if k == 0 else f"attn{k + 1}"
            H, dh = self.ax.size[qh], self.ax.size[qw]
            K = att.kv or H
            gqa = K != H
            sp = self.spaces.get(base)
            if sp is None:
                sp = self.spaces[base] = Space(base, "heads", "Heads", "H", H, heads_dim="H", kv_dim="K" if gqa else None, dh_dim="dh")
                qk_tags = self.related_tags(qw) | self.related_tags(kw)
                sp.qk, sp.rot, why_qk = self.qk_group(qw, kw, qk_tags)
                sp.rope_layout = self.rope_layout
                sp.ov, why_ov = largest(self.related_tags(vw) - {"product"})
                sp.ov = meet(sp.ov, "GL")
                sp.qk_chain = ["O", "Id"] if sp.qk == "GL" else ["Id"] if sp.qk != "Id" else []
                sp.ov_chain = [g for g in SHRINK.get(sp.ov, []) if g in ("O", "Id")]
                sp.evidence.append(f"{att.node} in {att.module or 'the model'}: {H} query heads of width {dh}"
                                   + (f", {K} key/value heads (grouped-query attention)" if gqa else ""))
                if sp.qk == "RoPE":
                    pairs = "dims (2i, 2i + 1)" if sp.rope_layout == "interleaved" else "dims i and i + half"
                    sp.evidence.append(f"rotary embeddings: {pairs} of each query and key head are rotated together by a position-dependent table"
                                       + (f"; only the first {sp.rot} dims of a head rotate" if sp.rot and sp.rot < dh else ""))
                elif why_qk:
                    sp.evidence.append(f"QK maps limited to {sp.qk}: {', '.join(why_qk)}")
                if why_ov:
                    sp.evidence.append(f"OV maps limited to {sp.ov}: {', '.join(why_ov)}")
                if sp.rot and sp.rot < dh:
                    sp.rot_dim = "r"
                    self.dims.setdefault("r", ("", sp.rot, "rotated dims of each head"))
                self.dims.setdefault("H", ("", H, "attention heads"))
                self.dims.setdefault("dh", ("", dh, "width of a head"))
                if gqa:
                    self.dims.setdefault("K", ("", K, "key/value heads"))
            sp.instances.add(layer)
            self.head_of[qh] = (base, layer, False)
            if gqa and kh is not None:
                self.head_of[kh] = (base, layer, True)
            elif gqa:  # a single key/value head: its projection has no head axis
                self.single_kv.add(base)
            self.within_of[qw] = (base, layer, "qk", False)
            self.within_of.setdefault(kw, (base, layer, "qk", True))
            self.within_of[vw] = (base, layer, "ov", False)

    def qk_group(self, qw: int, kw: int, tags: set[str]) -> tuple[str, int | None, list[str]]:
        rot = self._rope(qw)
        layout = self.rope_layout
        if rot is not None and self._rope(kw) == rot and self.rope_layout == layout:
            rest = tags - {"varying", "product"}
            g, why = largest(rest)
            return ("RoPE", rot, []) if g == "GL" else ("Id", None, why)
        g, why = largest(tags)
        return meet(g, "GL"), None, why

    def _rope_interleaved(self, w: int) -> bool:
        """Pairs (2i, 2i + 1) rotated by a position-dependent table (GPT-J's rotate_every_two)."""
        ev = self.ax.every.get(self.ax.find(w), {})
        return (0 in ev and 1 in ev and self.ax.find(ev[0]) == self.ax.find(ev[1])
                and "varying" in self.related_tags(w))

    def _rope(self, w: int) -> int | None:
        """The rotated width of a head class whose halves are paired by a rotary table:
        the class (or its first segment) is cut into two halves that are one class, and it
        is multiplied by a position-dependent table."""
        n = self.ax.size[self.ax.find(w)]
        self.rope_layout = "half"
        if self._rope_interleaved(w):
            self.rope_layout = "interleaved"
            return n
        tiles = self.ax.tiling(w)
        if tiles and len(tiles) == 2 and self._rope_interleaved(tiles[0][2]) \
                and "varying" not in self.related_tags(tiles[1][2]):
            self.rope_layout = "interleaved"
            return tiles[0][1]
        if tiles and len(tiles) == 2 and tiles[0][1] * 2 == n and self.ax.find(tiles[0][2]) == self.ax.find(tiles[1][2]):
            return n if "varying" in self.related_tags(w) else None
        if tiles and len(tiles) == 2:
            first = tiles[0][2]
            r = tiles[0][1]
            sub = self.ax.tiling(first)
            if sub and len(sub) == 2 and sub[0][1] * 2 == r and self.ax.find(sub[0][2]) == self.ax.find(sub[1][2]) \
                    and "varying" in self.related_tags(first) and "varying" not in self.related_tags(tiles[1][2]):
                return r
        return None

    def _layer_of_module(self, module: str) -> int | None:
        m = re.search(r"\.(\d+)(\.|$)", module)
        return int(m.group(1)) if m else None

    # -- folding -----------------------------------------------------------------------
    def plan_folds(self) -> tuple[list[Fold], set[str], set[str], dict[int, str]]:
        """Norms whose output only layers read: their gain (and bias) fold into those
        layers. Returns the folds, the folded gains and biases, and the classes whose
        norm could not be folded (class root -> why)."""
        folds: list[Fold] = []
        gains: set[str] = set()
        biases: set[str] = set()
        unfoldable: dict[int, str] = {}
        lin_bias = {(lin.weight, lin.read_axis): lin.bias for lin in self.f.linears}
        for norm in self.f.norms:
            if norm.gain is None and norm.bias is None:
                continue
            cons = self.f.consumers.get(norm.output, [])
            readers = [(w, a) for kind, w, a in cons if kind == "linear"]
            other = sorted({kind for kind, _, _ in cons if kind != "linear"})
            root = self.ax.find(norm.atom)
            if not self.fold_ok or other or not readers:
                why = (f"its output also goes to {', '.join(other)}" if other else "nothing reads it" if not readers
                       else "folding it changed the function in the check")
                unfoldable[root] = f"{norm.gain or norm.bias}: {why}"
                continue
            into = [(w, a, lin_bias.get((w, a))) for w, a in dict.fromkeys(readers)]
            fold_bias = norm.bias is not None and all(b is not None for _, _, b in into)
            folds.append(Fold(norm.gain, norm.bias, norm.offset, into, fold_bias))
            if norm.gain:
                gains.add(norm.gain)
            if norm.bias and fold_bias:
                biases.add(norm.bias)
        return folds, gains, biases, unfoldable

    # -- plain spaces ------------------------------------------------------------------
    def plain_spaces(self, unfoldable: dict[int, str]) -> None:
        order: list[int] = []
        for _pname, atoms in self.f.param_atoms.items():
            for a in atoms:
                r = self.ax.find(a)
                if r not in order and not self._structured(r):
                    order.append(r)
        emb = self._embedding_class()
        per_layer: dict[int | None, int] = {}
        for r in order:
            axes = self._axes_of(r)
            if self.ax.size[r] <= 1 or not any(role in ("co", "contra") for _, _, roles in axes for role in roles):
                continue  # gains and biases alone: nothing writes or reads through it
            tiles = self.ax.tiling(r)
            if tiles and all(self.ax.find(c) in order or self._structured(self.ax.find(c)) for _, _, c in tiles):
                continue  # a fused axis (Phi-3's gate_up) is its pieces' spaces, concatenated
            tags = self.related_tags(r)
            g, why = largest(tags)
            if r in unfoldable:
                kind = "rms" if "rms" in tags or "sumsq" in tags else "layernorm"
                g = meet(g, "SP" if kind == "rms" else "S")
                why.append(f"a norm whose gain cannot be folded ({unfoldable[r]})")
            layers = {layer_of(p) for p, _, _ in axes if layer_of(p) is not None}
            index = layers.pop() if len(layers) == 1 and r != emb and not any(layer_of(p) is None for p, _, _ in axes) else None
            if g == "Id":
                self.unexplained.append((self._where(axes), ", ".join(why) or "no symmetry"))
                continue
            if index is None and r == emb:
                base = "resid"
            elif index is None:
                k = per_layer.get(None, 0)
                per_layer[None] = k + 1
                base = "hidden" if k == 0 else f"hidden{k + 1}"
            else:
                k = sum(1 for (b, i) in self.class_space.values() if i == index and b != "resid")
                stem = "mlp" if any(t.startswith(("nonlinear", "odd", "homogeneous", "product")) for t in tags) else "hidden"
                base = stem if k == 0 else f"{stem}{k + 1}"
            sp = self.spaces.get(base)
            if sp is None:
                dim = "d" if base == "resid" else "f" if base == "mlp" else f"n_{base}"
                sp = self.spaces[base] = Space(base, "plain", g, dim, self.ax.size[r], chain=list(SHRINK[g]))
                sp.evidence.append(f"{self._where(axes)}: " + (", ".join(why) if why else "only linear maps act on it"))
                self.dims.setdefault(dim, ("", self.ax.size[r], ""))
            elif self.ax.size[r] != sp.size:
                self.notes.append(f"{base}: layer {index} has width {self.ax.size[r]}, not {sp.size}; its bindings are kept per layer")
            sp.instances.add(index)
            if meet(sp.group, g) != sp.group:
                sp.group = meet(sp.group, g)
                sp.chain = list(SHRINK[sp.group])
            self.class_space[r] = (base, index)
            if base == "resid" and r in unfoldable and "layernorm" in tags:
                self.spaces["sgn"] = Space("sgn", "sign", "Sign", "d", self.ax.size[r], {None}, ["Id"],
                                           ["LayerNorm(-y) = -LayerNorm(y): a global sign of the residual stream passes its norms"])

    def _structured(self, r: int) -> bool:
        """A class described by an attention's heads (split into heads and head width), or
        by a mixture of experts (the router's outputs, the experts' units)."""
        if r in self.within_of or r in self.head_of or r in self.expert_classes:
            return True
        for kids in self.ax.splits.get(r, {}).values():
            if len(kids) == 2 and self.ax.find(kids[0]) in self.head_of:
                return True
        tiles = self.ax.tiling(r)
        return bool(tiles and all(self._structured(self.ax.find(c)) for _, _, c in tiles))

    def _embedding_class(self) -> int | None:
        for pname, roles in self.f.roles.items():
            if any("index" in rs for rs in roles.values()):
                for axis, rs in roles.items():
                    if "co" in rs:
                        return self.ax.find(self.f.param_atoms[pname][axis])
        # no embedding (a vision model): the class most parameters write into
        best, count = None, -1
        tally: dict[int, int] = {}
        for pname, roles in self.f.roles.items():
            for axis, rs in roles.items():
                if "co" in rs:
                    r = self.ax.find(self.f.param_atoms[pname][axis])
                    tally[r] = tally.get(r, 0) + 1
        for r, c in tally.items():
            if c > count:
                best, count = r, c
        return best

    def _axes_of(self, r: int) -> list[tuple[str, int, set[str]]]:
        out = []
        for pname, atoms in self.f.param_atoms.items():
            for axis, a in enumerate(atoms):
                if self.ax.find(a) == r:
                    out.append((pname, axis, self.f.roles.get(pname, {}).get(axis, set())))
        return out

    def _where(self, axes: list[tuple[str, int, set[str]]]) -> str:
        names = [f"{p}[{a}]" for p, a, _ in axes]
        return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")

    # -- scalings ----------------------------------------------------------------------
    def scales(self) -> None:
        """Diagonal scalings: a gated unit's linear factor (``D``), a ReLU-like unit's input
        (``Dpos``). A fused gate/up weight split by a chunk scales the piece that is the
        linear factor only; an expert weight's scaling acts on the experts' units
        (``D(E * f)``)."""
        self.scaled: dict[tuple[str, int], tuple[str, int | None, bool]] = {}
        #: (weight, axis, piece of a concatenated axis) -> the scaling on that piece
        self.scaled_piece: dict[tuple[str, int, int], tuple[str, int | None, bool]] = {}
        lin_by_weight = {lin.weight: lin for lin in self.f.linears}
        readers = self._readers_of_nodes()
        dense_gate = any(g[1] in lin_by_weight for g in self.f.gates)
        for kind, items in (("gate", self.f.gates), ("relu", self.f.homogeneous)):
            for node, weight, *rest in items:
                piece = rest[1] if len(rest) > 2 else None
                piece_node = rest[2] if len(rest) > 2 else None
                lin = lin_by_weight.get(weight)
                expert = self.expert_params.get(weight) if kind == "gate" else None
                if lin is None and expert is None:
                    continue
                axis = expert[1] if expert is not None else lin.write_axis  # type: ignore[union-attr]
                r = self.ax.find(self.f.param_atoms[weight][axis])
                if piece is not None:
                    tiles = self.ax.tiling(r)
                    if not tiles or piece >= len(tiles):
                        continue
                    r = self.ax.find(tiles[piece][2])
                owner = (expert[4], expert[5]) if expert is not None else self.class_space.get(r)
                if owner is None:
                    continue
                output = piece_node or (lin.output if lin is not None else None)
                if kind == "gate" and rest and output and self._depends_on(rest[0], output):
                    continue  # x * f(x): the same layer on both sides (a GELU written out), not a gate
                if kind == "relu":
                    tags = self.related_tags(r)
                    if any(t.startswith(("nonlinear", "odd", "product")) for t in tags):
                        continue
                reads = readers.get(node, [])
                if not reads:
                    continue
                base = ("eup" if expert is not None and dense_gate else "up") if kind == "gate" else "scale"
                group = "D" if kind == "gate" else "Dpos"
                sp = self.spaces.get(base)
                if sp is None:
                    if expert is not None:
                        dim, size = f"E * {self.spaces[owner[0]].dim}", self.dims["E"][1] * self.ax.size[r]
                    else:
                        dim, size = self.spaces[owner[0]].dim, self.ax.size[r]
                    sp = self.spaces[base] = Space(base, "scale", group, dim, size, chain=["Dpos", "Id"] if group == "D" else ["Id"])
                    sp.evidence.append(f"{weight}: " + ("its output multiplies an activation of another layer (a gated unit), "
                                                        "so it can be scaled and its readers undo the scale" if kind == "gate"
                                                        else "a ReLU-like unit reads it: f(a x) = a f(x) for a > 0")
                                       + (f" (piece {piece} of its output, split by a chunk)" if piece is not None else "")
                                       + ("; each expert's units are scaled on their own" if expert is not None else ""))
                sp.instances.add(owner[1])
                if piece is None:
                    self.scaled[(weight, axis)] = (base, owner[1], False)
                else:
                    self.scaled_piece[(weight, axis, piece)] = (base, owner[1], False)
                if lin is not None and lin.bias:
                    if piece is None:
                        self.scaled[(lin.bias, 0)] = (base, owner[1], False)
                    else:
                        self.scaled_piece[(lin.bias, 0, piece)] = (base, owner[1], False)
                for w, a in reads:
                    self.scaled[(w, a)] = (base, owner[1], True)

    def _readers_of_nodes(self) -> dict[str, list[tuple[str, int]]]:
        """Node -> the layers that read it (through ops that only copy or reshape)."""
        from .walk import TRANSPARENT

        graph_nodes = self.f.nodes
        out: dict[str, list[tuple[str, int]]] = {}
        by_input: dict[str, list[Any]] = {}
        for lin in [*self.f.linears, *self.f.experts]:
            by_input.setdefault(lin.input, []).append(lin)
        for name in [n for n, *_ in self.f.gates] + [n for n, _ in self.f.homogeneous]:
            todo, seen, got = [graph_nodes[name]], set(), []
            while todo:
                n = todo.pop()
                if n.name in seen:
                    continue
                seen.add(n.name)
                got += [(lin.weight, lin.read_axis) for lin in by_input.get(n.name, [])]
                for u in n.users:
                    op = getattr(u.target, "__name__", "").split(".")[0]
                    if op in TRANSPARENT or op in ("view", "reshape", "_unsafe_view", "unsqueeze"):
                        todo.append(u)
            out[name] = got
        return out

    def _depends_on(self, node: str, target: str) -> bool:
        todo, seen = [self.f.nodes[node]], set()
        while todo:
            n = todo.pop()
            if n.name == target:
                return True
            if n.name in seen:
                continue
            seen.add(n.name)
            todo.extend(n.all_input_nodes)
        return False

    # -- bindings ----------------------------------------------------------------------
    def describe(self, atom: int, dual: bool, absval: bool = False) -> AxisExpr | None:
        r = self.ax.find(atom)
        if r in self.within_of and self.within_of[r][0] in self.single_kv:  # multi-query: k and v are one head
            base, idx, part, side = self.within_of[r]
            return axis_expr([[term(base, idx, part + ".kv", dual != side)]])
        if r in self.class_space:
            base, idx = self.class_space[r]
            return axis_expr([[term(base, idx, "", dual, absval)]])
        if r in self.router_of:
            base, idx = self.router_of[r]
            return axis_expr([[term(base, idx, "router", dual)]])
        for _sizes, kids in self.ax.splits.get(r, {}).items():
            if len(kids) != 2:
                continue
            h, w = self.ax.find(kids[0]), self.ax.find(kids[1])
            if h in self.head_of and w in self.within_of:
                base, idx, kv = self.head_of[h]
                b2, _, part, side = self.within_of[w]
                if b2 != base:
                    continue
                return axis_expr([[term(base, idx, part + (".kv" if kv else ""), dual != side)]])
            if h in self.head_of:  # per head: [q | k | v] (GPT-NeoX's fused layout)
                tiles = self.ax.tiling(w)
                if tiles:
                    base, idx, kv = self.head_of[h]
                    chains = []
                    for _, _, c in tiles:
                        cw = self.ax.find(c)
                        if cw not in self.within_of:
                            chains = []
                            break
                        _, _, part, side = self.within_of[cw]
                        chains.append([term(base, idx, part + (".kv" if kv else ""), dual != side)])
                    if chains:
                        return axis_expr(chains, cat=True, heads=self.spaces[base].heads_dim)
        tiles = self.ax.tiling(r)
        if tiles:
            chains = []
            for _, _, c in tiles:
                sub = self.describe(c, dual, absval)
                if sub is None or sub.cat:
                    return None
                chains.append(list(sub.segments[0].terms))
            return axis_expr(chains, cat=True)
        return None

    def bindings(self, folded_gains: set[str], folded_biases: set[str], unfoldable: dict[int, str]) -> dict[str, Any]:
        params: dict[str, Any] = {}
        self.param_notes: dict[str, str] = {}
        for pname in self.tensors:
            atoms = self.f.param_atoms.get(pname)
            roles = self.f.roles.get(pname, {})
            if atoms is None:
                params[pname] = "invariant"
                self.param_notes[pname] = "not used by the traced forward"
                continue
            if pname in folded_gains or pname in folded_biases:
                params[pname] = "invariant"
                self.param_notes[pname] = "1 after fold_norm" if pname in folded_gains else "0 after fold_norm"
                continue
            if pname in self.expert_params:
                params[pname] = self._expert_binding(pname, atoms, roles)
                continue
            axes: list[AxisExpr] = []
            for axis, a in enumerate(atoms):
                rs = roles.get(axis, set())
                if self.tensors[pname].shape[axis] == 1 or not rs & {"co", "contra", "gain", "normbias"}:
                    axes.append(UNTOUCHED)
                    continue
                dual = "contra" in rs and "co" not in rs
                absval = "gain" in rs
                b = self.describe(a, dual, absval)
                if b is None:
                    axes.append(UNTOUCHED)
                    continue
                chains = [list(c.terms) for c in b.segments]
                sc = self.scaled.get((pname, axis))
                if sc is not None and not b.cat and len(chains[0]) == 1:
                    chains[0].append(term(sc[0], sc[1], "", sc[2]))
                if b.cat:
                    for i, chain in enumerate(chains):
                        sp_ = self.scaled_piece.get((pname, axis, i))
                        if sp_ is not None and len(chain) == 1:
                            chain.append(term(sp_[0], sp_[1], "", sp_[2]))
                if "sgn" in self.spaces and not b.cat and any(t.space == "resid" for t in chains[0]):
                    sign = self._sign_of(pname, axis)
                    if sign is not None:
                        chains[0].insert(0, term("sgn", None, "", sign))
                axes.append(axis_expr(chains, b.cat, b.heads))
            params[pname] = axes
        return params

    def _expert_binding(self, pname: str, atoms: list[int], roles: dict[int, set[str]]) -> list[AxisExpr]:
        """An expert weight, seen through its view: the expert and unit axes merged (the
        experts' units, expert-major; a fused gate/up as ``cat(..., heads=E)``), and the
        residual axis."""
        view, unit_axis, other, pieces, base, idx = self.expert_params[pname]
        unit_dual = "contra" in roles.get(unit_axis, set()) and "co" not in roles.get(unit_axis, set())
        unit = term(base, idx, "", unit_dual)
        chains = [[unit] for _ in range(pieces)]
        for i, chain in enumerate(chains):
            sc = self.scaled_piece.get((pname, unit_axis, i)) if pieces > 1 else self.scaled.get((pname, unit_axis))
            if sc is not None:
                chain.append(term(sc[0], sc[1], "", sc[2]))
        units = axis_expr(chains, cat=True, heads="E") if pieces > 1 else axis_expr(chains)
        rs = roles.get(other, set())
        resid = self.describe(atoms[other], "contra" in rs and "co" not in rs) or UNTOUCHED
        return [units if len(g) == 2 else resid for g in view]

    def _sign_of(self, pname: str, axis: int) -> bool | None:
        """Does the global sign reach this axis, and dually? None: it does not. A sign
        passes adds, copies and LayerNorms (odd), not an activation such as GELU: each
        group of residual-stream activations joined by adds and copies is signed unless
        one of them is an activation's input or output. A gain whose norm turns an
        unsigned input into a signed output carries the sign itself."""
        signed = self._signed_nodes()
        out: set[bool | None] = set()
        for role, node, src in self.f.sites.get((pname, axis), set()):
            if role in ("co", "normbias"):
                out.add(False if signed.get(node, False) else None)
            elif role == "contra":
                out.add(True if signed.get(node, False) else None)
            elif role == "gain":
                out.add(False if signed.get(node, False) != signed.get(src, False) else None)
        return out.pop() if len(out) == 1 else None

    def _signed_nodes(self) -> dict[str, bool]:
        if hasattr(self, "_signed_cache"):
            return self._signed_cache
        from .walk import ACTIVATIONS, ODD, PERMUTE, RESHAPE, TRANSPARENT, _opname

        roots = {r for r, (b, _) in self.class_space.items() if b == "resid"}
        nodes = [n for n in self.f.nodes.values() if n.name in self.f.node_atom and self.ax.find(self.f.node_atom[n.name]) in roots]
        names = {n.name for n in nodes}
        parent = {n: n for n in names}

        def find(x: str) -> str:
            while parent[x] != x:
                parent[x] = parent[parent[x]]
                x = parent[x]
            return x

        linking = TRANSPARENT | RESHAPE | PERMUTE | {"add", "sub", "getitem", "select", "slice", "cat"}
        bad: set[str] = set()
        for n in nodes:
            op = _opname(n)
            if op in ACTIVATIONS and op not in ODD:
                bad.add(n.name)
            for u in n.users:
                uop = _opname(u)
                if u.name in names and (uop in linking or (uop in ("mul", "div") and any(not hasattr(a, "name") for a in u.args))):
                    parent[find(u.name)] = find(n.name)
                if uop in ACTIVATIONS and uop not in ODD:
                    bad.add(n.name)
        unsigned = {find(x) for x in bad}
        self._signed_cache = {n: find(n) not in unsigned for n in names}
        return self._signed_cache

    # -- ties and centring -------------------------------------------------------------
    def plan_ties(self, folds: list[Fold]) -> tuple[list[tuple[str, str]], list[str]]:
        ties, untie = [], []
        done: set[str] = set()
        folded_into = {w for fold in folds for w, _, _ in fold.into} | {b for fold in folds if fold.fold_bias for _, _, b in fold.into if b}
        for pname, names in self.f.aliases.items():
            if len(names) < 2 or pname in done:
                continue
            done.update(names)
            used = [n for n in names if n in self.f.param_atoms]
            first = names[0]
            for other in names[1:]:
                ties.append((first, other))
            # a fold that changes one side of a tie and not the other: the spec unties it
            for n in names[1:]:
                if n in folded_into or (first in folded_into and n not in folded_into):
                    untie.append(n)
            if not untie and len(used) > 1:
                self.notes.append(f"{', '.join(names)} stay tied: the residual's group must act the same on both")
        return ties, untie

    def plan_center(self, folds: list[Fold]) -> dict[str, int]:
        """Writers of an OC residual, mean-centred, when every layer that reads it reads
        a LayerNorm's output."""
        resid = self.spaces.get("resid")
        if resid is None or resid.group != "OC":
            return {}
        roots = [r for r, (b, _) in self.class_space.items() if b == "resid"]
        norm_readers = {(w, a) for cons in self.f.consumers.values() for kind, w, a in cons if kind == "linear"}
        lns = [n for n in self.f.norms if n.kind == "layernorm"]
        if not lns:
            return {}
        out: dict[str, int] = {}
        for r in roots:
            for pname, axis, roles in self._axes_of(r):
                if "contra" in roles and (pname, axis) not in norm_readers:
                    self.notes.append(f"no mean-centring: {pname} reads the residual stream without a LayerNorm")
                    return {}
                if "co" in roles and "normbias" not in roles and "gain" not in roles:
                    out[pname] = axis
        return out

    # -- dims ---------------------------------------------------------------------------
    def name_dims(self) -> None:
        config = getattr(self.model, "config", None)
        cands = {
            "d": ["hidden_size", "n_embd", "d_model", "embed_dim", "dim", "width", "hidden_dim"],
            "H": ["num_attention_heads", "n_head", "num_heads", "n_heads", "encoder_attention_heads", "decoder_attention_heads"],
            "K": ["num_key_value_heads", "n_kv_heads", "num_kv_heads", "multi_query_group_num", "n_head_kv"],
            "dh": ["head_dim", "kv_channels", "d_head", "d_kv"],
            "f": ["intermediate_size", "n_inner", "ffn_dim", "d_ff", "mlp_dim", "ffn_hidden_size", "n_ff", "ffn_dim"],
            "E": ["num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts"],
            "fe": ["moe_intermediate_size", "expert_intermediate_size", "intermediate_size"],
        }
        for sp in self.spaces.values():
            if sp.kind == "plain":
                self.dims.setdefault(sp.dim, ("", sp.size, ""))
        sizes = {k: v[1] for k, v in self.dims.items()}
        out: dict[str, tuple[str, int, str]] = {}
        for sym, (_, size, comment) in self.dims.items():
            expr = ""
            for attr in cands.get(sym, []):
                v = _config_get(config, attr)
                if isinstance(v, int) and not isinstance(v, bool) and v == size:
                    expr = f"config.{attr}"
                    break
            if not expr and sym == "dh" and "d" in sizes and "H" in sizes and sizes["d"] == sizes["H"] * size:
                expr = "d / H"
            if not expr and sym == "H":
                expr = self._module_attr(("num_heads", "n_head", "num_attention_heads", "n_heads"), size)
            if not expr and sym == "r":
                expr = self._module_attr(("rotary_ndims", "rotary_dim", "rot_dim", "rotary_emb_dim"), size)
            if not expr:
                expr = self._shape_expr(sym, size)
            out[sym] = (expr or str(size), size, comment)
        order = ["d", "H", "K", "dh", "f", "E", "fe", "r"]
        self.dims = {k: out[k] for k in sorted(out, key=lambda k: (order.index(k) if k in order else len(order), k))}

    def _module_attr(self, names: Iterable[str], size: int) -> str:
        for mname, mod in self.model.named_modules():
            for a in names:
                v = getattr(mod, a, None)
                if isinstance(v, int) and not isinstance(v, bool) and v == size and mname:
                    return f'attr("{mname}.{a}")'
        return ""

    def _shape_expr(self, sym: str, size: int) -> str:
        bases = [b for b, sp in self.spaces.items() if sp.dim == sym]
        for r, (b, _) in self.class_space.items():
            if b in bases:
                for pname, axis, _ in self._axes_of(r):
                    if self.tensors.get(pname) is not None and self.tensors[pname].shape[axis] == size:
                        return f'shape("{pname}", {axis})'
        return ""


def _config_get(config: Any, attr: str) -> Any:
    if config is None:
        return None
    if isinstance(config, dict):
        return config.get(attr)
    try:
        return getattr(config, attr, None)
    except Exception:
        return None
