"""Mixture-of-experts layers: a permutation of the experts with one element per expert
for its hidden units, and a view of the router's expert axis.

``Experts(8, S(14336))`` is the symmetry of a Mixtral block's experts: the router's
softmax and top-k are equivariant under a permutation of the experts (the same
permutation moves the router's rows and the experts' weights), and inside each expert
its hidden units may be permuted as in any MLP, each expert by its own permutation.
The group is the wreath product S(f) wr S(E): an expert permutation ``perm`` [E] and
the stacked within-expert elements [E, ...].

Representations:

- ``()`` (natural): the experts' units one expert after the other, an axis of E*f
  features (the expert and unit axes of a [E, f, d] weight merged with a ``view:``, see
  docs/spec-language.md): ``x'[e] = g[e] . x[perm[e]]``;
- ``("router",)``: an axis of E features (the router's rows, its logits):
  ``x'[e] = x[perm[e]]``.

It is a head group (:class:`~symspec.groups.Heads`) with two parts, the units (unnamed)
and the router (``Id(1)`` per expert), one key/value head per expert: every solver and
parametrisation of head groups serves it (the expert assignment sums the routers' and the
units' similarities, then each expert's units are solved by the within group's solver,
batched over the experts).
"""

from __future__ import annotations

import ast
from typing import ClassVar

import attrs

from ..errors import GroupError
from .base import Group, Path, register
from .classic import Id
from .heads import Heads
from .text import CallParser, DimArg, GroupCall

_ROUTER = "router"


@register
@attrs.frozen
class Experts(Heads):
    """Expert permutations with one within-expert element (its hidden units) per expert: mixture-of-experts layers."""

    kind: ClassVar[str] = "Experts"

    @classmethod
    def of(cls, experts: int, within: Group) -> Experts:
        return cls(experts, (("", within), (_ROUTER, Id(1))), experts)

    def __attrs_post_init__(self) -> None:
        if not isinstance(self.heads, int) or self.heads < 1:
            raise ValueError(f"the number of experts must be a positive integer, got {self.heads!r}")
        if self.kv != self.heads:
            raise ValueError("every expert is its own group (kv = the number of experts)")
        names = [p for p, _ in self.parts]
        if names != ["", _ROUTER] or self.parts[1][1] != Id(1):
            raise ValueError("Experts holds the units' group and the router's view (Id(1)); build it as Experts(E, S(f))")
        if isinstance(self.parts[0][1], Heads):
            raise ValueError("a within-expert group cannot itself be a head or expert group")

    @property
    def within_group(self) -> Group:
        return self.parts[0][1]

    @classmethod
    def from_call(cls, node: ast.Call, parser: CallParser) -> GroupCall:
        """``Experts(E, within)``: the number of experts and the group of each expert's units."""
        if len(node.args) != 2 or node.keywords:
            raise GroupError("Experts takes the number of experts and the group of one expert's units, e.g. Experts(8, S(f))")
        experts = parser.dim(node.args[0], "Experts: experts")
        within = parser.call(node.args[1])
        if issubclass(within.cls, Heads):
            raise GroupError("Experts: a within-expert group cannot itself be a head or expert group")
        router = GroupCall(Id, (("size", DimArg(ast.Constant(1))),))
        return GroupCall(cls, (("heads", experts), ("parts", (("", within), (_ROUTER, router))), ("kv", experts)),
                         ((), (_ROUTER,)))

    def __str__(self) -> str:
        return f"Experts({self.heads}, {self.within_group})"

    def rep_paths(self) -> list[Path]:
        return [(), (_ROUTER,)]

    def permutation_subgroup(self) -> Group:
        """The permutations in the group: the expert permutation and each expert's units'
        permutation subgroup (S stays S)."""
        return Experts.of(self.heads, self.within_group.permutation_subgroup())

    def fixed_subgroup(self) -> Group:
        """The expert permutation alone (as a head group keeps its head permutation: the
        representations need the expert structure)."""
        return Experts.of(self.heads, Id(self.within_group.n))

    def contains_matrix(self, m, atol: float = 1e-8) -> bool:  # type: ignore[no-untyped-def]
        """Membership of the natural-representation matrix: a block permutation of the
        experts with one within-group block per expert."""
        return Heads(self.heads, (("", self.within_group),)).contains_matrix(m, atol)
