"""The text form of groups, ``Heads(H, qk=GL(d / H), ov=GL(d / H))``: one parser.

Text is parsed (with ``ast``) into a call tree, :class:`GroupCall`: the group kinds and
their arguments by field, each integer argument kept as its expression (:class:`DimArg`).
What does not depend on the integers is checked then (known kinds, arguments, options,
and what a kind refuses whatever the sizes); evaluating the tree with a function from
expressions to integers builds the group, which is when sizes are checked. :func:`parse`
reads literal groups (``S(3)``); a spec's group text, whose integers are dimension
expressions, is the same tree evaluated with the model's dimensions
(:mod:`symspec.spec.groupexpr`).

Most kinds are written as their fields in order, the keyword fields as options; a kind
with another text form says how to read it in a ``from_call(node, parser)`` class method
(:meth:`symspec.groups.Heads.from_call`).

>>> str(parse("Heads(4, qk=GL(8), ov=GL(8))"))
'Heads(4, qk=GL(8), ov=GL(8))'
>>> parse("S(3)") == parse(str(parse("S(3)")))
True
"""

from __future__ import annotations

import ast
from collections.abc import Callable
from typing import Any

import attrs

from ..errors import GroupError, suggest
from .base import ALIASES, REGISTRY, Group, Path

#: checks an integer argument's expression when it is parsed; ``where`` names the argument
#: (``"S: size"``) for its error message
DimCheck = Callable[[ast.expr, str], None]
#: the value of an integer argument's expression
IntEval = Callable[[ast.expr], int]


class UnknownGroupError(GroupError):
    """Group text that calls names which are no group kind (every one of them, in ``kinds``)."""

    def __init__(self, kinds: list[str]) -> None:
        self.kinds = kinds
        hint = suggest(kinds[0], REGISTRY, aliases=ALIASES)
        super().__init__(f"unknown group '{kinds[0]}'" + (f"; {hint}" if hint else f"; known: {', '.join(sorted(REGISTRY))}"))


@attrs.frozen(eq=False)
class DimArg:
    """An integer argument: its expression, evaluated when the group is built."""

    node: ast.expr

    def evaluate(self, integer: IntEval) -> int:
        return integer(self.node)


@attrs.frozen(eq=False)
class GroupCall:
    """One group kind with its arguments, by field: literals (enum and float options),
    :class:`DimArg`, nested calls, and for a head group its parts ``((name, call), ...)``."""

    cls: type[Group]
    fields: tuple[tuple[str, Any], ...]
    #: the representation paths of the group, whatever the integers
    paths: tuple[Path, ...] = ((),)

    def evaluate(self, integer: IntEval) -> Group:
        values = {name: _evaluate(value, integer) for name, value in self.fields}
        try:
            return self.cls(**values)
        except (ValueError, TypeError) as e:  # the sizes the group refuses
            raise GroupError(f"{self.cls.kind}: {e}") from None

    def dims(self) -> list[DimArg]:
        """Every integer argument, nested calls included."""
        out: list[DimArg] = []
        for _, value in self.fields:
            for v in ([p for _, p in value] if isinstance(value, tuple) else [value]):
                if isinstance(v, DimArg):
                    out.append(v)
                elif isinstance(v, GroupCall):
                    out += v.dims()
        return out


def _evaluate(value: Any, integer: IntEval) -> Any:
    if isinstance(value, (DimArg, GroupCall)):
        return value.evaluate(integer)
    if isinstance(value, tuple):  # a head group's parts
        return tuple((name, call.evaluate(integer)) for name, call in value)
    return value


@attrs.frozen
class CallParser:
    """Reads call expressions into :class:`GroupCall` trees; ``check`` vets each integer
    argument's expression (literals only, or a spec's dimension expressions)."""

    check: DimCheck

    def tree(self, node: ast.expr) -> GroupCall:
        """The whole text's tree; names that are no group kind are reported all at once."""
        unknown = [n.func.id for n in ast.walk(node)
                   if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id not in REGISTRY]
        if unknown:
            raise UnknownGroupError(unknown)
        return self.call(node)

    def call(self, node: ast.expr) -> GroupCall:
        """One group: a call of a registered kind, read by its kind's text form."""
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name):
            raise GroupError(f"'{ast.unparse(node)}' is not a group (expected e.g. S(n), O(n), GL(n))")
        cls = REGISTRY.get(node.func.id)
        if cls is None:
            raise UnknownGroupError([node.func.id])
        custom = getattr(cls, "from_call", None)
        return custom(node, self) if custom is not None else self.fields_form(cls, node)

    def dim(self, node: ast.expr, where: str) -> DimArg:
        """An integer argument (``where`` names it in errors)."""
        self.check(node, where)
        return DimArg(node)

    def fields_form(self, cls: type[Group], node: ast.Call) -> GroupCall:
        """The text form of most kinds: the fields in order, the keyword fields as options."""
        name = cls.kind
        fields = list(attrs.fields(cls))
        positional = [f for f in fields if f.name not in cls.keyword_fields]
        if len(node.args) > len(positional):
            raise GroupError(f"{name} takes at most {len(positional)} positional argument(s), got {len(node.args)}")
        values = {f.name: self._argument(cls, f, arg) for f, arg in zip(positional, node.args)}
        known = {f.name: f for f in fields}
        for kw in node.keywords:
            if kw.arg is None or kw.arg not in known:
                hint = suggest(kw.arg or "", known)
                raise GroupError(f"{name} has no option '{kw.arg}'" + (f"; {hint}" if hint else ""))
            values[kw.arg] = self._argument(cls, known[kw.arg], kw.value)
        missing = [f.name for f in fields if f.name not in values and f.default is attrs.NOTHING]
        if missing:
            raise GroupError(f"{name} needs {', '.join(missing)}")
        return GroupCall(cls, tuple(values.items()))

    def _argument(self, cls: type[Group], f: attrs.Attribute, node: ast.expr) -> Any:
        """One argument, as its field's kind (``metadata["kind"]``, int by default) reads it."""
        kind = f.metadata.get("kind", "int")
        if kind == "group":
            return self.call(node)
        if kind == "enum":
            choices: tuple[str, ...] = f.metadata["choices"]
            if isinstance(node, ast.Name) and node.id in choices:
                return node.id
            if isinstance(node, ast.Constant) and node.value in choices:
                return node.value
            raise GroupError(f"{cls.kind}: option {f.name} must be one of {', '.join(choices)}, got '{ast.unparse(node)}'")
        if kind == "float":
            if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
                return float(node.value)
            raise GroupError(f"{cls.kind}: option {f.name} must be a number, got '{ast.unparse(node)}'")
        return self.dim(node, f"{cls.kind}: {f.name}")


def literal_int(node: ast.expr) -> int:
    """The value of an integer literal (``3``, ``-3``); GroupError for anything else."""
    if isinstance(node, ast.Constant) and isinstance(node.value, int) and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -literal_int(node.operand)
    raise GroupError(f"expected an integer, got '{ast.unparse(node)}'")


def _check_literal(node: ast.expr, where: str) -> None:
    try:
        literal_int(node)
    except GroupError:
        raise GroupError(f"{where} must be an integer, got '{ast.unparse(node)}'") from None


LITERAL = CallParser(_check_literal)


def parse(text: str) -> Group:
    """A group from its text form, with literal integers (``str(g)`` parses back to ``g``).

    >>> str(parse("RoPE(8, rot=4)"))
    'RoPE(8, rot=4)'
    """
    try:
        tree = ast.parse(text.strip(), mode="eval")
    except SyntaxError as e:
        raise GroupError(f"cannot parse group '{text}': {e.msg} at column {e.offset}") from None
    return LITERAL.tree(tree.body).evaluate(literal_int)
