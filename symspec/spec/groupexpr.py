"""A space's group as a spec writes it, ``Heads(H, qk=GL(d / H), ov=GL(d / H))``, parsed once.

The text is parsed into a symbolic form (:mod:`symspec.groups.text`, the one parser of
group text): the group kinds and their arguments, each integer argument kept as a
dimension expression. Everything that does not depend on the dimensions is checked when
it is parsed (known kinds, arguments and options, the dimension expressions and the names
they read), and the representation paths are known then; binding evaluates it with the model's dimensions, which is when sizes are checked
(``S(0)``, a ``kv`` that does not divide the heads).

>>> e = parse_group_expr("Heads(H, qk=GL(d / H), ov=GL(d / H))")
>>> sorted(e.names), e.rep_paths()
(['H', 'd'], [('qk',), ('qk', 'kv'), ('ov',), ('ov', 'kv')])
>>> str(e.evaluate(DimContext({"H": 2, "d": 8})))
'Heads(2, qk=GL(4), ov=GL(4))'
"""

from __future__ import annotations

import ast
import functools

import attrs

from ..groups import Group, Path
from ..groups.text import CallParser, GroupCall, UnknownGroupError
from .exprs import DimContext, names_in, parse_python_expr, validate_expr

__all__ = ["GroupExpr", "UnknownGroupError", "parse_group_expr"]


@attrs.frozen(eq=False)
class GroupExpr:
    """A group's text and its symbolic form (see the module's docstring)."""

    text: str
    root: GroupCall
    #: the dimension names it reads
    names: frozenset[str]

    def rep_paths(self) -> list[Path]:
        """The representation paths of the group, whatever the dimensions."""
        return list(self.root.paths)

    def evaluate(self, ctx: DimContext) -> Group:
        """The group for these dimensions; :class:`~symspec.errors.GroupError` for sizes it
        refuses, :class:`~symspec.spec.exprs.ExprError` for a dimension that does not evaluate."""
        return self.root.evaluate(ctx.evaluate)

    def __str__(self) -> str:
        return self.text


def _check_dim(node: ast.expr, where: str) -> None:
    validate_expr(node)


#: group text whose integer arguments are dimension expressions
DIMENSIONS = CallParser(_check_dim)


@functools.lru_cache(maxsize=1024)
def parse_group_expr(text: str) -> GroupExpr:
    """Parse group text (once per text: the result is cached). Raises
    :class:`~symspec.spec.exprs.ExprError` for text that is no expression or for a
    malformed dimension argument, :class:`UnknownGroupError` for names that are no group
    kind, :class:`~symspec.errors.GroupError` for wrong arguments or options."""
    root = DIMENSIONS.tree(parse_python_expr(text, what="group"))
    return GroupExpr(text, root, frozenset(n for d in root.dims() for n in names_in(d.node)))
