"""From the graph's facts to a spec draft: spaces, bindings, canonicalisation, dims.

A :class:`Draft` is mutable: the verification (:mod:`.api`) shrinks a space's group when
its check fails and renders the draft again. Bindings are kept as structure (a chain of
factors, or a concatenation of chains) so that a space shrunk to the identity simply
disappears from every axis that named it.
"""

from __future__ import annotations

import re

import attrs

from ..spec.model import AxisExpr, Chain, SpaceDecl, Term

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
    """A space as the draft proposes it: its candidate group (``group``, or a head group's
    ``qk``/``ov`` parts, an expert group's ``within``), what the shrinking tries next
    (``chain``...), the evidence and how it shrank. Not a second model of a spec's space:
    :meth:`decl` is the :class:`~symspec.spec.model.SpaceDecl` the spec declares now."""

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
    #: a parameter holds one entry per head (Swin's relative position bias table): a part
    #: ``pos=Id(1)`` moves it with the head permutation
    table: bool = False
    #: a head group's head width and key/value heads, as read (a family has one size)
    dh_size: int = 0
    kv_size: int = 0
    #: False once the head permutation itself failed the check (a per-head table pins the heads)
    permute: bool = True
    #: (qk, ov, qk_chain, ov_chain) as first proposed: the shrinking starts again from
    #: there without the head permutation
    start: tuple[str, str, list[str], list[str]] | None = None
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
            fixed = "" if self.permute else ", perm=False"
            table = ", pos=Id(1)" if self.table and self.permute else ""
            return f"Heads({self.heads_dim}, qk={qk}, ov={self.ov}({self.dh_dim}){table}{kv}{fixed})"
        if self.kind == "experts":
            return f"Experts({self.experts_dim}, {self.within}({self.dim}))"
        return f"{self.group}({self.dim})"

    @property
    def alive(self) -> bool:
        return self.group != "Id"

    def key(self) -> str:
        return self.decl().key

    def decl(self) -> SpaceDecl:
        """The space as the spec declares it (per layer where it has one instance per layer;
        ``doc``: the evidence, and what shrank)."""
        doc = "; ".join(self.evidence) if self.evidence else self.doc
        for before, after, why in self.history:
            doc += f"; {before} failed the check ({why}), shrunk to {after}"
        return SpaceDecl(self.base, None if None in self.instances else "i", self.group_text(), doc)


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
    #: each tie of the model, all the names sharing one tensor (T5: shared, both embeddings, lm_head)
    ties: list[tuple[str, ...]]
    untie: list[str]
    folds: list[Fold]
    center: dict[str, int]
    notes: list[str]
    #: what was not explained: (what, why)
    unexplained: list[tuple[str, str]]
    #: parameter -> the stored axes each bound axis sees (``view:``), for merged expert axes
    views: dict[str, tuple[tuple[int, ...], ...]] = attrs.field(factory=dict)
    #: the outputs the symmetries are read against (the spec's ``outputs``; empty: all)
    outputs: tuple[str, ...] = ()


def template_of(name: str) -> str:
    """``name`` with its first layer number as ``{i}``."""
    return _LAYER.sub(".{i}.", name, count=1)


def layer_of(pname: str) -> int | None:
    m = _LAYER.search(pname)
    return int(m.group(1)) if m else None

