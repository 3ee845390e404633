"""Head-structured groups: a permutation of attention heads combined with one
within-head element per head, for one or several named parts (QK and OV circuits).

``Heads(12, qk=GL(64), ov=GL(64))`` permutes 12 heads (the same permutation for every
part) and holds one GL(64) element per head for the QK circuit and one for the OV
circuit. With grouped-query attention, ``Heads(32, qk=RoPE(128), ov=GL(128), kv=8)``
has 8 key/value heads shared by groups of 4 query heads: the head permutation acts on
the key/value groups and on the query heads inside each group, and there is one
within-head element per key/value head, shared by its query heads.

Representations: ``qk`` acts on an axis of 32*128 query-head features (q_proj's output,
o_proj's input); ``qk.kv`` on an axis of 8*128 key/value-head features (k_proj's, v_proj's
output). A single-part group ``Heads(4, GL(8))`` has the paths ``()`` and ``("kv",)``.

Conventions (x'[i] = the new head i): for the query view
``x'[j, t] = g[j] . x[perm[j], qperm[j, t]]`` with j a key/value group and t a query head
in it; for the key/value view ``x'[j] = g[j] . x[perm[j]]``.
"""

from __future__ import annotations

import ast
from typing import Any, ClassVar

import attrs
import torch

from ..errors import GroupError
from .base import Element, Group, Path, Variance, make_generator, register
from .classic import Id
from .text import CallParser, GroupCall


def _index(e: Element, idx: torch.Tensor) -> Element:
    return {k: v.index_select(0, idx.to(v.device)) for k, v in e.items()}


@register
@attrs.frozen
class Heads(Group):
    """Head permutations with one within-head element per (key/value) head, per part."""

    kind: ClassVar[str] = "Heads"
    heads: int = attrs.field()
    parts: tuple[tuple[str, Group], ...] = attrs.field()
    kv: int = attrs.field(default=attrs.Factory(lambda self: self.heads, takes_self=True))
    #: False: the heads keep their places (only the within-head maps act): a per-head table
    #: the model does not let move with them (ALiBi's slopes, T5's relative position bias
    #: shared by every layer of a stack) pins them
    permute: bool = True

    def __attrs_post_init__(self) -> None:
        if not isinstance(self.heads, int) or self.heads < 1:
            raise ValueError(f"the number of heads must be a positive integer, got {self.heads!r}")
        if not isinstance(self.kv, int) or self.kv < 1 or self.heads % self.kv:
            raise ValueError(f"kv={self.kv!r} must divide the number of heads {self.heads}")
        if not self.parts:
            raise ValueError("Heads needs a within-head group")
        names = [p for p, _ in self.parts]
        if len(set(names)) != len(names) or ("" in names and len(names) > 1):
            raise ValueError("part names must be distinct")
        for name, g in self.parts:
            if isinstance(g, Heads):
                raise ValueError("a within-head group cannot itself be a head group")
            if name == "kv":
                raise ValueError("'kv' is reserved for the key/value view")

    # -- text form ---------------------------------------------------------------------
    @classmethod
    def from_call(cls, node: ast.Call, parser: CallParser) -> GroupCall:
        """``Heads(H, [within], kv=K, part=group, ...)``: the parts are named by keywords, and
        each has a query-head and a key/value view. What Heads refuses whatever the sizes is
        refused here, in its own words."""
        if not node.args:
            raise GroupError("Heads needs the number of heads, e.g. Heads(12, GL(64))")
        if len(node.args) > 2:
            raise GroupError("Heads takes the number of heads and at most one unnamed within-head group")
        fields: list[tuple[str, Any]] = [("heads", parser.dim(node.args[0], "Heads: heads"))]
        parts = [("", parser.call(node.args[1]))] if len(node.args) == 2 else []
        for kw in node.keywords:
            if kw.arg is None:
                raise GroupError("Heads does not take **kwargs")
            if kw.arg == "kv":
                fields.append(("kv", parser.dim(kw.value, "Heads: kv")))
            elif kw.arg == "perm":
                if not (isinstance(kw.value, ast.Constant) and isinstance(kw.value.value, bool)):
                    raise GroupError(f"Heads: perm must be True or False, got '{ast.unparse(kw.value)}'")
                fields.append(("permute", kw.value.value))
            else:
                parts.append((kw.arg, parser.call(kw.value)))
        names = [p for p, _ in parts]
        if not parts:
            raise GroupError("Heads: Heads needs a within-head group")
        if "" in names and len(names) > 1:
            raise GroupError("Heads: part names must be distinct")
        if any(issubclass(call.cls, Heads) for _, call in parts):
            raise GroupError("Heads: a within-head group cannot itself be a head group")
        fields.insert(1, ("parts", tuple(parts)))
        paths = tuple(p for name in names for p in (((name,), (name, "kv")) if name else ((), ("kv",))))
        return GroupCall(cls, tuple(fields), paths)

    def __str__(self) -> str:
        args = [str(self.heads)]
        for name, g in self.parts:
            args.append(f"{name}={g}" if name else str(g))
        if self.kv != self.heads:
            args.append(f"kv={self.kv}")
        if not self.permute:
            args.append("perm=False")
        return f"Heads({', '.join(args)})"

    # -- structure ---------------------------------------------------------------------
    @property
    def group_size(self) -> int:
        """Query heads per key/value head."""
        return self.heads // self.kv

    @property
    def n(self) -> int:
        return self.heads * self.parts[0][1].n

    def part(self, name: str) -> Group:
        for p, g in self.parts:
            if p == name:
                return g
        raise GroupError(f"{self} has no part '{name}'; parts: {', '.join(p for p, _ in self.parts)}")

    def rep_paths(self) -> list[Path]:
        out: list[Path] = []
        for name, _ in self.parts:
            base: Path = (name,) if name else ()
            out += [base, (*base, "kv")]
        return out

    def _split(self, path: Path) -> tuple[str, bool]:
        self._check_path(path)
        kv = bool(path) and path[-1] == "kv"
        name = path[0] if path and path[0] != "kv" else ""
        return name, kv

    def rep_size(self, path: Path = ()) -> int:
        name, kv = self._split(path)
        return (self.kv if kv else self.heads) * self.part(name).n

    def is_orthogonal(self, path: Path = ()) -> bool:
        name, _ = self._split(path)
        return self.part(name).is_orthogonal()

    @staticmethod
    def _prefix(part: str) -> str:
        # an unnamed part's fields still get a prefix: a within-head S(n) has its own 'perm'
        return f"{part or 'within'}."

    def _key(self, part: str, field: str) -> str:
        return self._prefix(part) + field

    def within(self, a: Element, part: str) -> Element:
        """The stacked within-head elements [kv, ...] of one part."""
        prefix = self._prefix(part)
        g = self.part(part)
        keys = g.identity(batch=()).keys()
        return {k: a[prefix + k] for k in keys}

    def permutation_subgroup(self) -> Group:
        """The head permutations only: every part's within-head group becomes Id (the
        paper's baseline searches no within-head map)."""
        return Heads(self.heads, tuple((name, Id(g.n)) for name, g in self.parts), self.kv, self.permute)

    def is_trivial(self) -> bool:
        return not self.permute and all(g.is_trivial() for _, g in self.parts)

    def fixed_subgroup(self) -> Group:
        """The same as :meth:`permutation_subgroup`: a head group's representations need
        its head structure, which Id(n) does not have, so the head permutation stays
        searchable."""
        return self.permutation_subgroup()

    def embed(self, sub: Group, a: Element, dtype: torch.dtype = torch.float64) -> Element:
        if sub != self and isinstance(sub, Heads):  # part by part, in the parts' own groups
            parts = {name: g.embed(sub.part(name), sub.within(a, name), dtype) for name, g in self.parts}
            return self._assemble(a["perm"], a["qperm"], parts)
        return super().embed(sub, a, dtype)

    def _assemble(self, perm: torch.Tensor, qperm: torch.Tensor, parts: dict[str, Element]) -> Element:
        out: Element = {"perm": perm, "qperm": qperm}
        for name, e in parts.items():
            for k, v in e.items():
                out[self._key(name, k)] = v
        return out

    # -- the group law -----------------------------------------------------------------
    def identity(self, *, batch=(), dtype=torch.float64, device=None) -> Element:
        if batch:
            raise GroupError("head groups do not take batch dimensions")
        perm = torch.arange(self.kv, device=device)
        qperm = torch.arange(self.group_size, device=device).expand(self.kv, self.group_size).clone()
        return self._assemble(perm, qperm, {p: g.identity(batch=(self.kv,), dtype=dtype, device=device) for p, g in self.parts})

    def compose(self, a: Element, b: Element) -> Element:
        pa, pb = a["perm"], b["perm"]
        perm = pb[pa]
        qb = b["qperm"][pa]
        qperm = torch.gather(qb, -1, a["qperm"])
        parts = {p: g.compose(self.within(a, p), _index(self.within(b, p), pa)) for p, g in self.parts}
        return self._assemble(perm, qperm, parts)

    def inverse(self, a: Element) -> Element:
        inv = torch.argsort(a["perm"])
        qperm = torch.argsort(a["qperm"], dim=-1)[inv]
        parts = {p: _index(g.inverse(self.within(a, p)), inv) for p, g in self.parts}
        return self._assemble(inv, qperm, parts)

    def sample(self, seed=None, *, batch=(), dtype=torch.float64, device=None, cond=10.0) -> Element:
        if batch:
            raise GroupError("head groups do not take batch dimensions")
        gen = make_generator(seed)
        perm = torch.randperm(self.kv, generator=gen)
        qperm = torch.argsort(torch.rand(self.kv, self.group_size, generator=gen), dim=-1)
        if not self.permute:
            perm, qperm = torch.sort(perm).values, torch.sort(qperm, dim=-1).values  # the same draws, in place
        parts = {p: g.sample(gen, batch=(self.kv,), dtype=dtype, device=device, cond=cond) for p, g in self.parts}
        return self._assemble(perm.to(device), qperm.to(device), parts)

    def apply(self, a: Element, x: torch.Tensor, path: Path = (), variance: Variance = "co") -> torch.Tensor:
        name, kv_view = self._split(path)
        g = self.part(name)
        dh = g.n
        shape = x.shape
        x = x.contiguous()  # an input axis moved to the front: the reshapes below would copy anyway
        perm = a["perm"].to(x.device)
        if kv_view:
            y = x.reshape(self.kv, dh, -1).index_select(0, perm)  # [kv, dh, R]
            y = g.apply(self.within(a, name), y, (), variance)
            return y.reshape(shape)
        gs = self.group_size
        y = x.reshape(self.kv, gs, dh, -1).index_select(0, perm)  # [kv, gs, dh, R]
        if gs > 1:
            q = a["qperm"].to(x.device)[:, :, None, None].expand(self.kv, gs, dh, y.shape[-1])
            y = torch.gather(y, 1, q)
        r = y.shape[-1]
        y = y.permute(0, 2, 1, 3).reshape(self.kv, dh, gs * r)
        y = g.apply(self.within(a, name), y, (), variance)
        return y.reshape(self.kv, dh, gs, r).permute(0, 2, 1, 3).reshape(shape)

    def element_ok(self, a: Element, atol: float) -> bool:
        ref = self.identity()
        if set(a) != set(ref):
            return False
        if tuple(a["perm"].shape) != (self.kv,) or tuple(a["qperm"].shape) != (self.kv, self.group_size):
            return False
        if not bool((torch.sort(a["perm"]).values == torch.arange(self.kv, device=a["perm"].device)).all()):
            return False
        ar = torch.arange(self.group_size, device=a["qperm"].device)
        if not bool((torch.sort(a["qperm"], dim=-1).values == ar).all()):
            return False
        if not self.permute and not (bool((a["perm"] == torch.arange(self.kv, device=a["perm"].device)).all())
                                     and bool((a["qperm"] == ar).all())):
            return False
        return all(g.contains(self.within(a, p), atol) for p, g in self.parts)

    def contains(self, a: Element | torch.Tensor, atol: float = 1e-8) -> bool:
        if isinstance(a, torch.Tensor):
            return self.contains_matrix(a, atol)
        try:
            return self.element_ok(a, atol)
        except (KeyError, RuntimeError, IndexError, ValueError):
            return False

    def contains_matrix(self, m: torch.Tensor, atol: float = 1e-8) -> bool:
        """Membership of a single-part group's query-view matrix: a block permutation
        that keeps key/value groups together, with one within-head block per group."""
        if len(self.parts) != 1:
            raise GroupError(f"{self}: test membership of a multi-part head group on elements")
        g = self.parts[0][1]
        dh = g.n
        if m.shape != (self.n, self.n):
            return False
        blocks = m.reshape(self.heads, dh, self.heads, dh).permute(0, 2, 1, 3)  # [i, j, dh, dh]
        nz = blocks.abs().amax(dim=(-1, -2)) > atol
        if not bool((nz.sum(1) == 1).all() and (nz.sum(0) == 1).all()):
            return False
        src = nz.to(torch.int64).argmax(1)  # new head i reads old head src[i]
        if not self.permute and not bool((src == torch.arange(self.heads, device=src.device)).all()):
            return False
        gs = self.group_size
        for j in range(self.kv):
            olds = src[j * gs : (j + 1) * gs] // gs
            if not bool((olds == olds[0]).all()):
                return False
            first = blocks[j * gs, src[j * gs]]
            for t in range(gs):
                if not torch.allclose(blocks[j * gs + t, src[j * gs + t]], first, atol=atol, rtol=0):
                    return False
            if not g.contains_matrix(first, atol):
                return False
        return True

    def equal(self, a: Element, b: Element, atol: float = 1e-9) -> bool:
        return all(
            torch.allclose(self.matrix(a, p), self.matrix(b, p).to(self.matrix(a, p).dtype), atol=atol, rtol=0)
            for p in self.rep_paths()
        )
