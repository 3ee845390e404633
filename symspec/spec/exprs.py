"""Dimension expressions: ``config.n_embd``, ``d / H``, ``shape("lm_head.weight", 0)``.

A small, safe subset of Python expressions evaluated with :mod:`ast`: integer literals,
names of other dimensions, ``config.<attr>[.<attr>...]``, ``+ - * / // %`` (``/`` must
divide exactly), and the functions ``shape(param, axis)``, ``first(a, b, ...)`` (the
first one that exists and is not None), ``min``, ``max``, and ``attr(path)``: an
integer attribute of the model itself or of a submodule, for models without a config
(timm's ViT: ``attr("blocks.0.attn.num_heads")``).
"""

from __future__ import annotations

import ast
import re
from collections.abc import Callable, Mapping
from typing import Any

import attrs

FUNCTIONS = ("shape", "first", "min", "max", "attr")
#: the longest expression text accepted: Python's parser, and the walkers here, recurse
#: once per operator, and a long chain (1+1+...+1) exhausts the stack
MAX_EXPR_CHARS = 1000
#: the deepest expression tree accepted (validation and evaluation recurse per level)
MAX_EXPR_DEPTH = 100


class ExprError(Exception):
    """An expression that cannot be parsed or evaluated (the message says why)."""


class _Missing(Exception):
    pass


def parse_expr(text: str | int) -> ast.expr:
    if isinstance(text, bool):
        raise ExprError(f"expected an integer expression, got {text!r}")
    if isinstance(text, int):
        return ast.Constant(text)
    if not isinstance(text, str):
        raise ExprError(f"expected an integer expression, got {_short(repr(text))}")
    node = parse_python_expr(text)
    validate_expr(node)
    return node


def parse_python_expr(text: str, what: str = "") -> ast.expr:
    """``text`` parsed as a Python expression, within :data:`MAX_EXPR_CHARS` and
    :data:`MAX_EXPR_DEPTH` (group expressions are parsed with this too: ``what="group"``
    names them in the error)."""
    if len(text) > MAX_EXPR_CHARS:
        raise ExprError(f"the expression is {len(text):,} characters long; at most {MAX_EXPR_CHARS:,} are accepted")
    try:
        node = ast.parse(text.strip(), mode="eval").body
    except SyntaxError as e:
        raise ExprError(f"cannot parse {what + ' ' if what else ''}'{_short(text)}': {e.msg}") from None
    except (RecursionError, MemoryError):  # the parser's own limits on nesting
        raise ExprError(f"'{_short(text)}' nests too deeply to parse") from None
    stack = [(node, 1)]
    while stack:  # iteratively: the depth limit is what keeps the recursive walkers safe
        sub, depth = stack.pop()
        if depth > MAX_EXPR_DEPTH:
            raise ExprError(f"'{_short(text)}' nests deeper than {MAX_EXPR_DEPTH} levels")
        stack.extend((c, depth + 1) for c in ast.iter_child_nodes(sub))
    return node


def _short(text: str, limit: int = 60) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def static_errors(node: ast.expr) -> list[str]:
    """What is wrong with a parsed expression whatever the model: a division by a literal
    zero (``d // 0``, ``d % (2 - 2)``), a literal ``/`` that does not divide (``7 / 2``).
    Validation reports these without a model; binding would find them only later.

    >>> static_errors(parse_expr("config.n_embd // (2 - 2)"))
    ["'config.n_embd // (2 - 2)': division by zero"]
    >>> static_errors(parse_expr("d / H")), static_errors(parse_expr('shape("w", 0) // 2'))
    ([], [])
    """
    literal = DimContext()
    out: list[str] = []
    names = {id(sub.args[0]) for sub in ast.walk(node)
             if isinstance(sub, ast.Call) and isinstance(sub.func, ast.Name) and sub.func.id in ("shape", "attr") and sub.args}
    for sub in ast.walk(node):
        if isinstance(sub, ast.Constant) and isinstance(sub.value, str) and id(sub) not in names:
            out.append(f"{_short(ast.unparse(sub))} is a string, not a number (quoted names belong in shape() and attr())")
        if not isinstance(sub, ast.BinOp):
            continue
        if _is_literal(sub):
            try:
                literal.evaluate(sub)
            except ExprError as e:
                out.append(str(e))
        elif isinstance(sub.op, (ast.Div, ast.FloorDiv, ast.Mod)) and _is_literal(sub.right):
            try:
                divisor = literal.evaluate(sub.right)
            except ExprError:  # reported at the literal itself
                continue
            if divisor == 0:
                out.append(f"'{ast.unparse(sub)}': division by zero")
    return list(dict.fromkeys(out))


def literal_value(node: ast.expr) -> int | None:
    """The value of an expression that reads nothing from a model (``16``, ``-4``,
    ``2 * 8``), else None (also when it cannot be evaluated: :func:`static_errors` says why).

    >>> literal_value(parse_expr("2 * 8")), literal_value(parse_expr("config.n_embd - 100"))
    (16, None)
    """
    if not _is_literal(node):
        return None
    try:
        return DimContext().evaluate(node)
    except ExprError:
        return None


def _is_literal(node: ast.expr) -> bool:
    """Whether ``node`` reads nothing from a model: integers, operators, min/max/first."""
    for sub in ast.walk(node):
        if isinstance(sub, ast.Attribute) or (isinstance(sub, ast.Constant) and not isinstance(sub.value, int)):
            return False
        if isinstance(sub, ast.Call) and not (isinstance(sub.func, ast.Name) and sub.func.id in ("min", "max", "first")):
            return False
    return not names_in(node)


_BINOPS: dict[type, Callable[[int, int], int]] = {
    ast.Add: lambda a, b: a + b,
    ast.Sub: lambda a, b: a - b,
    ast.Mult: lambda a, b: a * b,
    ast.FloorDiv: lambda a, b: a // b,
    ast.Mod: lambda a, b: a % b,
}


def validate_expr(node: ast.expr) -> None:
    """Raise :class:`ExprError` unless ``node`` is in the dimension-expression language."""
    if isinstance(node, ast.Constant):
        if not isinstance(node.value, (int, str)) or isinstance(node.value, bool):
            raise ExprError(f"unsupported constant {node.value!r}")
    elif isinstance(node, ast.Name):
        pass
    elif isinstance(node, ast.Attribute):
        base = node
        while isinstance(base, ast.Attribute):
            base = base.value  # type: ignore[assignment]
        if not (isinstance(base, ast.Name) and base.id == "config"):
            raise ExprError(f"attribute access is only allowed on config, got '{ast.unparse(node)}'")
    elif isinstance(node, ast.BinOp):
        if not isinstance(node.op, (*_BINOPS, ast.Div)):
            raise ExprError(f"unsupported operator in '{ast.unparse(node)}'")
        validate_expr(node.left)
        validate_expr(node.right)
    elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        validate_expr(node.operand)
    elif isinstance(node, ast.Call):
        if not isinstance(node.func, ast.Name) or node.func.id not in FUNCTIONS:
            raise ExprError(f"unknown function in '{ast.unparse(node)}'; functions: {', '.join(FUNCTIONS)}")
        if node.keywords:
            raise ExprError(f"{node.func.id}() takes no keyword arguments")
        for a in node.args:
            validate_expr(a)
    else:
        raise ExprError(f"unsupported expression '{ast.unparse(node)}'")


def names_in(node: ast.expr) -> set[str]:
    """Dimension names an expression refers to (not ``config``, not function names)."""
    out: set[str] = set()
    for sub in ast.walk(node):
        if isinstance(sub, ast.Name) and sub.id != "config" and sub.id not in FUNCTIONS:
            out.add(sub.id)
    return out


@attrs.define
class DimContext:
    """What an expression may read: other dims, the model's config, parameter shapes."""

    dims: Mapping[str, int] = attrs.field(factory=dict)
    config: Any = None
    shapes: Mapping[str, tuple[int, ...]] = attrs.field(factory=dict)
    #: the model itself (``attr(path)`` reads its public attributes), when bound to one
    module: Any = None

    def evaluate(self, node: ast.expr) -> int:
        try:
            value = self._eval(node)
        except _Missing as e:
            raise ExprError(str(e)) from None
        if isinstance(value, bool) or not isinstance(value, int):
            raise ExprError(f"'{ast.unparse(node)}' is {value!r}, not an integer")
        return value

    def _eval(self, node: ast.expr) -> Any:
        if isinstance(node, ast.Constant):
            return node.value
        if isinstance(node, ast.Name):
            if node.id not in self.dims:
                raise _Missing(f"unknown dimension '{node.id}'")
            return self.dims[node.id]
        if isinstance(node, ast.Attribute):
            chain: list[str] = []
            cur: ast.expr = node
            while isinstance(cur, ast.Attribute):
                chain.append(cur.attr)
                cur = cur.value
            obj = self.config
            if obj is None:
                raise _Missing(f"'{ast.unparse(node)}': the model has no config")
            for attr in reversed(chain):
                if isinstance(obj, Mapping):
                    if attr not in obj:
                        raise _Missing(f"'{ast.unparse(node)}': config has no '{attr}'")
                    obj = obj[attr]
                else:
                    if not hasattr(obj, attr):
                        raise _Missing(f"'{ast.unparse(node)}': config has no '{attr}'")
                    obj = getattr(obj, attr)
            return obj
        if isinstance(node, ast.UnaryOp):
            return -self._int(node.operand)
        if isinstance(node, ast.BinOp):
            a, b = self._int(node.left), self._int(node.right)
            if isinstance(node.op, ast.Div):
                if b == 0 or a % b:
                    raise ExprError(f"'{ast.unparse(node)}': {a} is not divisible by {b}")
                return a // b
            if isinstance(node.op, (ast.FloorDiv, ast.Mod)) and b == 0:
                raise ExprError(f"'{ast.unparse(node)}': division by zero")
            return _BINOPS[type(node.op)](a, b)
        if isinstance(node, ast.Call):
            fname = node.func.id  # type: ignore[attr-defined]
            if fname == "first":
                for arg in node.args:
                    try:
                        v = self._eval(arg)
                    except _Missing:
                        continue
                    if v is not None:
                        return v
                raise _Missing(f"'{ast.unparse(node)}': none of the alternatives exists")
            if fname == "attr":
                return self._attr(node)
            if fname in ("min", "max"):
                vals = [self._int(a) for a in node.args]
                if not vals:
                    raise ExprError(f"{fname}() needs arguments")
                return min(vals) if fname == "min" else max(vals)
            if fname == "shape":
                if len(node.args) != 2 or not isinstance(node.args[0], ast.Constant) or not isinstance(node.args[0].value, str):
                    raise ExprError('shape() takes a quoted parameter name and an axis: shape("lm_head.weight", 0)')
                name = node.args[0].value
                axis = self._int(node.args[1])
                if name not in self.shapes:
                    raise _Missing(f"shape(): the model has no parameter '{name}'")
                shp = self.shapes[name]
                if not -len(shp) <= axis < len(shp):
                    raise ExprError(f"shape(): '{name}' has {len(shp)} axes, no axis {axis}")
                return shp[axis]
        raise ExprError(f"cannot evaluate '{ast.unparse(node)}'")

    def _attr(self, node: ast.Call) -> Any:
        if len(node.args) != 1 or not isinstance(node.args[0], ast.Constant) or not isinstance(node.args[0].value, str):
            raise ExprError('attr() takes one quoted attribute path: attr("blocks.0.attn.num_heads")')
        path = node.args[0].value
        parts = path.split(".")
        if not all(re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_]*", p) for p in parts):
            raise ExprError(f"attr(): '{path}' is not a path of public attribute names")
        if self.module is None:
            raise _Missing(f"attr(\"{path}\"): not bound to a model")
        obj = self.module
        for p in parts:
            if not hasattr(obj, p):
                raise _Missing(f"attr(): the model has no '{path}'")
            obj = getattr(obj, p)
        return obj

    def _int(self, node: ast.expr) -> int:
        v = self._eval(node)
        if v is None:
            raise _Missing(f"'{ast.unparse(node)}' is None")
        if isinstance(v, bool) or not isinstance(v, int):
            raise ExprError(f"'{ast.unparse(node)}' is {v!r}, not an integer")
        return v


def evaluate_dims(exprs: Mapping[str, ast.expr], ctx: DimContext) -> tuple[dict[str, int], dict[str, str]]:
    """Evaluate named expressions in dependency order; returns (values, errors by name).
    A dimension is a size: a value of 0 or less is an error."""
    values: dict[str, int] = {}
    errors: dict[str, str] = {}
    pending = dict(exprs)
    while pending:
        progressed = False
        for name, node in list(pending.items()):
            deps = names_in(node)
            if deps & set(errors):
                errors[name] = f"depends on {', '.join(sorted(deps & set(errors)))}, which failed"
                del pending[name]
                progressed = True
                continue
            if not deps <= set(values):
                continue
            try:
                value = DimContext({**ctx.dims, **values}, ctx.config, ctx.shapes, ctx.module).evaluate(node)
            except ExprError as e:
                errors[name] = str(e)
            else:
                if value > 0:
                    values[name] = value
                else:  # a size: a group of size 0 or -36 is no group, and slicing by it fails far later
                    errors[name] = f"evaluates to {value}; a dimension is a positive integer (a size)"
            del pending[name]
            progressed = True
        if not progressed:
            for name in pending:
                errors[name] = "circular or undefined dimensions: " + ", ".join(sorted(names_in(pending[name]) - set(values)))
            break
    return values, errors
