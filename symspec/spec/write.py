"""Writing a :class:`~symspec.spec.model.Spec` as YAML, formatted like the built-in specs:
one line per dimension, space field and parameter, canonicalisation steps as short blocks.
The one writer of spec text: ``loads_spec(dump_spec(s)) == s`` for every spec ``s``.

``header`` lines become ``#`` comments above the spec, and ``notes`` end-of-line comments
on a dimension (``("dims", name)``), a parameter (``("params", pattern)``) or a step's
argument (``("canonicalize", index, arg)``); comments are not part of the spec.

>>> from symspec.spec import load_spec, loads_spec
>>> s = load_spec("nanogpt")
>>> loads_spec(dump_spec(s)) == s
True
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

import yaml

from .model import ParamDecl, SpaceDecl, Spec, StepDecl
from .steps import STEP_KINDS

#: what YAML reads as a line break
_BREAKS = ("\n", "\r", "\x85", "\u2028", "\u2029")
#: where a comment goes: ("dims", name), ("params", pattern), ("canonicalize", index, arg)
NoteKey = tuple[Any, ...]


def scalar(value: Any, flow: bool = False) -> str:
    """``value`` as one YAML scalar on one line, written by PyYAML (plain where YAML reads it
    back as the same value, else quoted; double-quoted with escapes where a quoted scalar
    would break the line). ``flow``: an item of a flow collection ``[a, b]`` or ``{a: b}``,
    where commas and brackets need quotes too. Hand-made quoting once wrote
    ``name: a: 'b' # c``.

    >>> print(scalar("a: 'b' # c"), scalar("x[i]", flow=True), scalar(1.0))
    'a: ''b'' # c' 'x[i]' 1
    """
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**53:
        return str(int(value))  # 1.0 reads back as 1, which equals it
    for style in (None, '"'):
        text = yaml.safe_dump([value] if flow else value, default_flow_style=True, default_style=style, width=math.inf,
                              allow_unicode=True).removesuffix("\n").removesuffix("\n...")
        if flow:
            text = text[1:-1]
        if not any(b in text for b in _BREAKS):
            return text
    raise ValueError(f"{value!r} cannot be written on one line")  # pragma: no cover - double quotes escape every break


def comment(text: str) -> str:
    """Text for a ``# ...`` comment: one line (an error message in a note may hold several),
    other characters a YAML file cannot hold written as escapes."""
    text = re.sub("|".join(_BREAKS), " ", text)
    return "".join(c if c.isprintable() or c == "\t" else c.encode("unicode_escape", "backslashreplace").decode("ascii")
                   for c in text)


def dump_spec(spec: Spec, *, header: Sequence[str] = (), notes: Mapping[NoteKey, str] | None = None) -> str:
    """``spec`` as YAML text; ``loads_spec(dump_spec(s)) == s`` (see the module)."""
    notes = notes or {}
    lines = [f"# {comment(h)}" if h else "#" for h in header]
    lines += ["symspec: 1" if spec.version == 1 else f"symspec: {scalar(spec.version)}", f"name: {scalar(spec.name)}"]
    if spec.description:
        lines.append(f"description: {scalar(spec.description)}")
    if spec.models:
        lines.append(f"models: [{', '.join(scalar(m, flow=True) for m in spec.models)}]")
    if spec.outputs:
        lines.append(f"outputs: [{', '.join(scalar(o, flow=True) for o in spec.outputs)}]")
    if spec.dims:
        lines += ["", "dims:"]
        lines += [f"  {scalar(d.name)}: {_number_or_text(d.expr)}" + _note(notes, ("dims", d.name)) for d in spec.dims]
    lines += ["", "spaces:" if spec.spaces else "spaces: {}"]
    for s in spec.spaces:
        lines += _space(s)
    if spec.ties:
        lines += ["", "ties:"] + [f"  - [{', '.join(scalar(p, flow=True) for p in t.params)}]" for t in spec.ties]
    if spec.canonicalize:
        lines += ["", "canonicalize:"]
        for i, step in enumerate(spec.canonicalize):
            lines += _step(step, {k[2]: v for k, v in notes.items() if k[:2] == ("canonicalize", i)})
    lines += ["", "params:" if spec.params else "params: {}"]
    lines += [f"  {scalar(p.pattern)}: {param_value(p)}" + _note(notes, ("params", p.pattern)) for p in spec.params]
    return "\n".join(lines) + "\n"


def _note(notes: Mapping[NoteKey, str], key: NoteKey) -> str:
    text = notes.get(key)
    return f"  # {comment(text)}" if text else ""


def _number_or_text(expr: str) -> str:
    """A dimension: an integer as a number, an expression as text."""
    return expr if re.fullmatch(r"[1-9][0-9]*", expr) else scalar(expr)


def _space(s: SpaceDecl) -> list[str]:
    out = [f"  {scalar(s.key)}:", f"    group: {scalar(s.group)}"]
    if s.doc:
        out.append(f"    doc: {scalar(s.doc)}")
    return out


def param_value(p: ParamDecl) -> str:
    """A parameter's value: ``invariant``, ``[axis, ...]``, or a flow mapping where it has
    a view or a doc."""
    fields: list[tuple[str, str]] = []
    if p.invariant:
        if not p.doc:
            return "invariant"
        fields.append(("invariant", "true"))
    else:
        axes = "[" + ", ".join(scalar("_" if a is None else str(a), flow=True) for a in (p.axes or ())) + "]"
        if p.view is None and not p.doc:
            return axes
        if p.view is not None:
            fields.append(("view", "[" + ", ".join(str(g[0]) if len(g) == 1 else "[" + ", ".join(map(str, g)) + "]"
                                                   for g in p.view) + "]"))
        fields.append(("axes", axes))
    if p.doc:
        fields.append(("doc", scalar(p.doc, flow=True)))
    return "{" + ", ".join(f"{k}: {v}" for k, v in fields) + "}"


def _step(step: StepDecl, notes: Mapping[str, str]) -> list[str]:
    """One ``canonicalize`` entry; arguments at their default are left out."""
    syntax = STEP_KINDS.get(step.kind)
    args = step.as_dict()
    if syntax is not None:
        args = {k: v for k, v in args.items() if (a := syntax.arg(k)) is None or a.default is None or v != a.default}
        if syntax.shorthand is not None and list(args) == [syntax.shorthand] and not isinstance(args[syntax.shorthand], (dict, list)):
            return [f"  - {step.kind}: {scalar(args[syntax.shorthand])}" + _note(notes, syntax.shorthand)]
    out = [f"  - {step.kind}:"]
    for key, value in args.items():
        note = _note(notes, key)
        if isinstance(value, list):
            out.append(f"      {scalar(key)}:{note}")
            out += [f"        - {_flow(item)}" for item in value]
        elif isinstance(value, dict):
            out.append(f"      {scalar(key)}:{note}")
            out += [f"        {scalar(k)}: {_flow(v)}" for k, v in value.items()]
        else:
            out.append(f"      {scalar(key)}: {scalar(value)}{note}")
    return out


def _flow(value: Any) -> str:
    """A value inside a block: a mapping or list written in flow style, a scalar plain."""
    if isinstance(value, dict):
        return "{" + ", ".join(f"{scalar(k, flow=True)}: {_flow_item(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(_flow_item(v) for v in value) + "]"
    return scalar(value)


def _flow_item(value: Any) -> str:
    return _flow(value) if isinstance(value, (dict, list)) else scalar(value, flow=True)
