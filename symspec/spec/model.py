"""The spec as frozen data: every node keeps where it came from (``loc``, not compared).

Axis expressions say how one axis of a parameter transforms:

- ``resid``: the residual space, covariant (rho(g) along the axis: an output axis);
- ``resid*``: contravariant, rho(g)^-T (an input axis, or the dual side of a pairing);
  ``dual(resid)`` is the same;
- ``abs(resid)``: |rho(g)| (a norm gain under signed permutations);
- ``ff[i]``: the space ``ff`` of the layer captured as ``{i}`` in the parameter's name;
- ``attn[i].qk``: a representation of a structured group (a head group's QK part;
  ``attn[i].qk.kv`` is its key/value-head view under grouped-query attention);
- ``mlp[i] @ up[i]``: a composition, read as matrices: ``up[i]`` acts first;
- ``cat(attn[i].qk, attn[i].qk*, attn[i].ov)``: the axis is a concatenation (fused qkv);
- ``cat(attn[i].qk, attn[i].qk*, attn[i].ov, heads=H)``: the same parts laid out per
  head, ``[h0: q k v][h1: q k v]...`` (GPT-NeoX's query_key_value);
- ``_``: the axis is untouched.

>>> str(parse_axis("cat(attn[i].qk, attn[i].qk*, attn[i].ov)"))
'cat(attn[i].qk, attn[i].qk*, attn[i].ov)'
>>> parse_axis("mlp[i] @ up[i]").segments[0].terms[1].space
'up'
>>> parse_axis("cat(attn[i].qk, attn[i].qk*, attn[i].ov, heads=H)").heads
'H'
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import attrs

from ..errors import Location, suggest
from .groupexpr import GroupExpr, parse_group_expr
from .templates import captures_of

_NOLOC = Location()


def _loc_field() -> Any:
    return attrs.field(default=_NOLOC, eq=False, repr=False)


@attrs.frozen
class Term:
    """One space's representation acting on (a segment of) an axis."""

    space: str
    index: str | int | None = None
    path: tuple[str, ...] = ()
    variance: str = "co"

    @property
    def ref(self) -> str:
        s = self.space
        if self.index is not None:
            s += f"[{self.index}]"
        if self.path:
            s += "." + ".".join(self.path)
        return s

    def __str__(self) -> str:
        if self.variance == "contra":
            return self.ref + "*"
        if self.variance == "abs":
            return f"abs({self.ref})"
        return self.ref


@attrs.frozen
class Chain:
    """Terms composed on one segment; ``terms[-1]`` acts first (matrix order)."""

    terms: tuple[Term, ...]

    def __str__(self) -> str:
        return " @ ".join(str(t) for t in self.terms)


#: keyword arguments of ``cat(...)``
CAT_KEYWORDS = ("heads",)


@attrs.frozen
class AxisExpr:
    segments: tuple[Chain, ...]
    cat: bool = False
    #: ``cat(..., heads=H)``: the parts are laid out per head (a dimension name or an
    #: integer): H blocks, each holding one head's slice of every part, in order
    heads: str | int | None = None

    def __str__(self) -> str:
        inner = ", ".join(str(c) for c in self.segments)
        if self.heads is not None:
            inner += f", heads={self.heads}"
        return f"cat({inner})" if self.cat else inner

    def terms(self) -> list[Term]:
        return [t for c in self.segments for t in c.terms]


class AxisSyntaxError(Exception):
    def __init__(self, message: str, column: int) -> None:
        super().__init__(message)
        self.column = column


_TOKEN = re.compile(r"\s*(?:(?P<ident>[A-Za-z_][A-Za-z0-9_]*)|(?P<int>\d+)|(?P<op>[\[\]().,@*=]))")


def _tokenize(text: str) -> list[tuple[str, str, int]]:
    out = []
    pos = 0
    while pos < len(text):
        if text[pos:].strip() == "":
            break
        m = _TOKEN.match(text, pos)
        if not m or m.end() == pos:
            col = pos + len(text[pos:]) - len(text[pos:].lstrip())
            raise AxisSyntaxError(f"unexpected character '{text[col]}'", col + 1)
        kind = m.lastgroup or ""
        out.append((kind, m.group(kind), m.start(kind) + 1))
        pos = m.end()
    return out


def parse_axis(text: str | None) -> AxisExpr | None:
    """Parse one axis expression; ``None``, ``'_'`` or ``'-'`` mean untouched."""
    if text is None:
        return None
    if not isinstance(text, str):
        raise AxisSyntaxError(f"an axis expression must be a string, got {text!r}", 1)
    if text.strip() in ("_", "-", ""):
        return None
    toks = _tokenize(text)
    p = _Parser(toks, text)
    expr = p.axis()
    if p.i < len(toks):
        raise AxisSyntaxError(f"unexpected '{toks[p.i][1]}'", toks[p.i][2])
    return expr


class _Parser:
    def __init__(self, toks: list[tuple[str, str, int]], text: str) -> None:
        self.toks = toks
        self.i = 0
        self.text = text

    def peek(self, value: str | None = None, kind: str | None = None) -> bool:
        if self.i >= len(self.toks):
            return False
        k, v, _ = self.toks[self.i]
        return (value is None or v == value) and (kind is None or k == kind)

    def take(self, value: str | None = None, kind: str | None = None, what: str = "") -> tuple[str, str, int]:
        if not self.peek(value, kind):
            got = f"'{self.toks[self.i][1]}'" if self.i < len(self.toks) else "the end"
            col = self.toks[self.i][2] if self.i < len(self.toks) else len(self.text) + 1
            raise AxisSyntaxError(f"expected {what or value or kind}, got {got}", col)
        tok = self.toks[self.i]
        self.i += 1
        return tok

    def axis(self) -> AxisExpr:
        if self.peek("cat", "ident") and self.i + 1 < len(self.toks) and self.toks[self.i + 1][1] == "(":
            self.i += 2
            segs = [self.chain()]
            heads: str | int | None = None
            while self.peek(","):
                self.i += 1
                if self.peek(kind="ident") and self.i + 1 < len(self.toks) and self.toks[self.i + 1][1] == "=":
                    heads = self.keyword()
                    break  # keywords come last
                segs.append(self.chain())
            self.take(")", what="')' closing cat(")
            if heads is not None and len(segs) < 2:
                raise AxisSyntaxError("heads= lays out two or more parts per head; a single part needs no layout", self.toks[self.i - 1][2])
            return AxisExpr(tuple(segs), cat=True, heads=heads)
        return AxisExpr((self.chain(),))

    def keyword(self) -> str | int:
        """``heads=H`` (a dimension name) or ``heads=4`` inside ``cat(...)``."""
        _, key, col = self.take(kind="ident")
        if key not in CAT_KEYWORDS:
            hint = suggest(key, CAT_KEYWORDS)
            raise AxisSyntaxError(f"cat() has no keyword '{key}'" + (f"; {hint}" if hint else f"; keywords: {', '.join(CAT_KEYWORDS)}"), col)
        self.take("=")
        kind, value, vcol = self.take(what="a number of heads (a dimension name or an integer)")
        if kind == "int":
            if int(value) < 1:
                raise AxisSyntaxError(f"heads={value}: the number of heads must be positive", vcol)
            return int(value)
        if kind != "ident":
            raise AxisSyntaxError(f"expected a number of heads (a dimension name or an integer), got '{value}'", vcol)
        return value

    def chain(self) -> Chain:
        terms = [self.term()]
        while self.peek("@"):
            self.i += 1
            terms.append(self.term())
        return Chain(tuple(terms))

    def term(self) -> Term:
        for fn, variance in (("dual", "contra"), ("abs", "abs")):
            if self.peek(fn, "ident") and self.i + 1 < len(self.toks) and self.toks[self.i + 1][1] == "(":
                self.i += 2
                t = self.ref()
                self.take(")", what=f"')' closing {fn}(")
                return attrs.evolve(t, variance=variance)
        t = self.ref()
        if self.peek("*"):
            self.i += 1
            t = attrs.evolve(t, variance="contra")
        return t

    def ref(self) -> Term:
        _, name, _ = self.take(kind="ident", what="a space name")
        index: str | int | None = None
        if self.peek("["):
            self.i += 1
            kind, value, col = self.take(what="a layer index")
            if kind == "int":
                index = int(value)
            elif kind == "ident":
                index = value
            else:
                raise AxisSyntaxError(f"expected a layer index, got '{value}'", col)
            self.take("]", what="']'")
        path: list[str] = []
        while self.peek("."):
            self.i += 1
            path.append(self.take(kind="ident", what="a part name")[1])
        return Term(name, index, tuple(path))


@attrs.frozen
class DimDecl:
    name: str
    expr: str
    loc: Location = _loc_field()


@attrs.frozen
class SpaceDecl:
    """A named space (``ff``, indexed per layer as ``ff[i]``) with its group expression."""

    name: str
    index: str | None
    group: str
    doc: str = ""
    loc: Location = _loc_field()

    @property
    def key(self) -> str:
        return f"{self.name}[{self.index}]" if self.index else self.name

    @property
    def expr(self) -> GroupExpr:
        """The group's symbolic form, to evaluate with a model's dimensions (parsed once
        per text; raises for text that is no group, which loading reports)."""
        return parse_group_expr(self.group)


@attrs.frozen
class ParamDecl:
    """A parameter name template (``transformer.h.{i}.mlp.c_fc.weight``) and its axes."""

    pattern: str
    axes: tuple[AxisExpr | None, ...] | None = None
    invariant: bool = False
    doc: str = ""
    loc: Location = _loc_field()
    axis_locs: tuple[Location, ...] = attrs.field(default=(), eq=False, repr=False)
    #: stored axes merged into the axes ``axes`` binds (``[[0, 1], 2]``), or None
    view: tuple[tuple[int, ...], ...] | None = None

    @property
    def captures(self) -> tuple[str, ...]:
        return captures_of(self.pattern)

    @property
    def spaces(self) -> frozenset[str]:
        """The names of the spaces its axes are bound to (none for an invariant one)."""
        return frozenset(t.space for ax in self.axes or () if ax is not None for t in ax.terms())


def _freeze(value: Any) -> Any:
    if isinstance(value, Mapping):
        return tuple((k, _freeze(v)) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return tuple(_freeze(v) for v in value)
    return value


@attrs.frozen
class StepDecl:
    """One canonicalisation step: its kind and its (validated) arguments."""

    kind: str
    args: tuple[tuple[str, Any], ...]
    loc: Location = _loc_field()

    @classmethod
    def make(cls, kind: str, args: Mapping[str, Any], loc: Location = _NOLOC) -> StepDecl:
        return cls(kind, _freeze(args), loc)

    def arg(self, name: str, default: Any = None) -> Any:
        for k, v in self.args:
            if k == name:
                return v
        return default

    def as_dict(self) -> dict[str, Any]:
        return {k: _thaw(v) for k, v in self.args}


def _thaw(value: Any) -> Any:
    if isinstance(value, tuple) and value and all(isinstance(x, tuple) and len(x) == 2 and isinstance(x[0], str) for x in value):
        return {k: _thaw(v) for k, v in value}
    if isinstance(value, tuple):
        return [_thaw(v) for v in value]
    return value


@attrs.frozen
class TieDecl:
    params: tuple[str, ...]
    loc: Location = _loc_field()


@attrs.frozen
class Spec:
    """A parsed, validated symmetry spec."""

    name: str
    version: int = 1
    description: str = ""
    models: tuple[str, ...] = ()
    dims: tuple[DimDecl, ...] = ()
    spaces: tuple[SpaceDecl, ...] = ()
    params: tuple[ParamDecl, ...] = ()
    ties: tuple[TieDecl, ...] = ()
    canonicalize: tuple[StepDecl, ...] = ()
    #: the model outputs the symmetries preserve (keys of its output mapping; empty:
    #: every floating-point output). An encoder-decoder returns its encoder's last hidden
    #: state beside the logits, in the residual stream's basis: a residual map moves it.
    outputs: tuple[str, ...] = ()
    source: str = attrs.field(default="<string>", eq=False)

    def space(self, name: str) -> SpaceDecl:
        for s in self.spaces:
            if s.name == name:
                return s
        raise KeyError(name)
