"""A space's group as a spec writes it, ``Heads(H, qk=GL(d / H), ov=GL(d / H))``, parsed once.

The text is parsed into a symbolic form: the group kinds and their arguments, each
integer argument kept as a dimension expression. Everything that does not depend on the
dimensions is checked when it is parsed (known kinds, arguments and options, the
dimension expressions and the names they read), and the representation paths are known
then; binding evaluates it with the model's dimensions, which is when sizes are checked
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
from collections.abc import Callable
from typing import Any

import attrs

from ..errors import GroupError, suggest
from ..groups import ALIASES, REGISTRY, Group, Heads, Path
from .exprs import DimContext, names_in, parse_python_expr, validate_expr


class UnknownGroupError(GroupError):
    """Group text that calls names which are no group kind (every one of them, in ``kinds``)."""

    def __init__(self, kinds: list[str]) -> None:
        self.kinds = kinds
        hint = suggest(kinds[0], REGISTRY, aliases=ALIASES)
        super().__init__(f"unknown group '{kinds[0]}'" + (f"; {hint}" if hint else f"; known: {', '.join(sorted(REGISTRY))}"))


@attrs.frozen(eq=False)
class DimArg:
    """An integer argument: a literal or a dimension expression, evaluated at binding."""

    node: ast.expr

    def evaluate(self, ctx: DimContext) -> int:
        return ctx.evaluate(self.node)


@attrs.frozen(eq=False)
class GroupCall:
    """One group kind with its arguments, by field: literals (enum and float options),
    :class:`DimArg`, nested calls, and for a head group its parts ``((name, call), ...)``."""

    cls: type[Group]
    fields: tuple[tuple[str, Any], ...]
    paths: tuple[Path, ...] = ((),)

    def evaluate(self, ctx: DimContext) -> Group:
        values = {name: _evaluate(value, ctx) for name, value in self.fields}
        try:
            return self.cls(**values)
        except (ValueError, TypeError) as e:  # the sizes the group refuses
            raise GroupError(f"{self.cls.kind}: {e}") from None

    def dims(self) -> list[DimArg]:
        """Every dimension argument, nested calls included."""
        out: list[DimArg] = []
        for _, value in self.fields:
            for v in ([p for _, p in value] if isinstance(value, tuple) else [value]):
                if isinstance(v, DimArg):
                    out.append(v)
                elif isinstance(v, GroupCall):
                    out += v.dims()
        return out


def _evaluate(value: Any, ctx: DimContext) -> Any:
    if isinstance(value, (DimArg, GroupCall)):
        return value.evaluate(ctx)
    if isinstance(value, tuple):  # a head group's parts
        return tuple((name, call.evaluate(ctx)) for name, call in value)
    return value


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
        return self.root.evaluate(ctx)

    def __str__(self) -> str:
        return self.text


@functools.lru_cache(maxsize=1024)
def parse_group_expr(text: str) -> GroupExpr:
    """Parse group text (once per text: the result is cached). Raises
    :class:`~symspec.spec.exprs.ExprError` for text that is no expression or for a
    malformed dimension argument, :class:`UnknownGroupError` for names that are no group
    kind, :class:`~symspec.errors.GroupError` for wrong arguments or options."""
    tree = parse_python_expr(text, what="group")
    unknown = [n.func.id for n in ast.walk(tree)
               if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id not in REGISTRY]
    if unknown:
        raise UnknownGroupError(unknown)
    root = _call(tree)
    return GroupExpr(text, root, frozenset(n for d in root.dims() for n in names_in(d.node)))


def _call(node: ast.expr) -> GroupCall:
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name):
        raise GroupError(f"'{ast.unparse(node)}' is not a group (expected e.g. S(n), O(n), GL(n))")
    cls = REGISTRY.get(node.func.id)
    if cls is None:
        raise UnknownGroupError([node.func.id])
    return CALL_FORMS.get(cls.kind, _fields_form)(cls, node)


def _dim(node: ast.expr) -> DimArg:
    validate_expr(node)
    return DimArg(node)


def _fields_form(cls: type[Group], node: ast.Call) -> GroupCall:
    """The text form of most kinds: the fields in order, the keyword fields as options."""
    name = cls.kind
    fields = list(attrs.fields(cls))
    positional = [f for f in fields if f.name not in cls.keyword_fields]
    if len(node.args) > len(positional):
        raise GroupError(f"{name} takes at most {len(positional)} positional argument(s), got {len(node.args)}")
    values = {f.name: _argument(cls, f, arg) for f, arg in zip(positional, node.args)}
    known = {f.name: f for f in fields}
    for kw in node.keywords:
        if kw.arg is None or kw.arg not in known:
            hint = suggest(kw.arg or "", known)
            raise GroupError(f"{name} has no option '{kw.arg}'" + (f"; {hint}" if hint else ""))
        values[kw.arg] = _argument(cls, known[kw.arg], kw.value)
    missing = [f.name for f in fields if f.name not in values and f.default is attrs.NOTHING]
    if missing:
        raise GroupError(f"{name} needs {', '.join(missing)}")
    return GroupCall(cls, tuple(values.items()))


def _argument(cls: type[Group], f: attrs.Attribute, node: ast.expr) -> Any:
    """One argument, as its field's kind (``metadata["kind"]``, int by default) reads it."""
    kind = f.metadata.get("kind", "int")
    if kind == "group":
        return _call(node)
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
    return _dim(node)


def _heads_form(cls: type[Group], node: ast.Call) -> GroupCall:
    """``Heads(H, [within], kv=K, part=group, ...)``: the parts are named by keywords (as
    :meth:`Heads.from_call` reads them), and each has a query-head and a key/value view."""
    if not node.args:
        raise GroupError("Heads needs the number of heads, e.g. Heads(12, GL(64))")
    if len(node.args) > 2:
        raise GroupError("Heads takes the number of heads and at most one unnamed within-head group")
    fields: list[tuple[str, Any]] = [("heads", _dim(node.args[0]))]
    parts = [("", _call(node.args[1]))] if len(node.args) == 2 else []
    for kw in node.keywords:
        if kw.arg is None:
            raise GroupError("Heads does not take **kwargs")
        if kw.arg == "kv":
            fields.append(("kv", _dim(kw.value)))
        else:
            parts.append((kw.arg, _call(kw.value)))
    # what Heads refuses whatever the sizes, in its own words
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


#: group kinds whose text form is not their fields in order
CALL_FORMS: dict[str, Callable[[type[Group], ast.Call], GroupCall]] = {Heads.kind: _heads_form}
