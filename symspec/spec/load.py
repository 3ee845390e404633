"""Reading, validating and writing spec files.

Validation collects every error of a file and reports each as
``file:line:col: key.path: message`` with a suggestion where one is likely.
"""

from __future__ import annotations

import ast
import keyword
import re
from pathlib import Path
from typing import Any

from ..errors import GroupError, SpecError, suggest
from ..groups import ALIASES, REGISTRY
from ..io_util import read_small_file
from .builtin import BUILTIN_PREFIX, builtin_names, builtin_path
from .exprs import ExprError, literal_value, names_in, parse_expr, static_errors
from .groupexpr import GroupExpr, UnknownGroupError, parse_group_expr
from .model import (
    AxisExpr,
    AxisSyntaxError,
    DimDecl,
    ParamDecl,
    SpaceDecl,
    Spec,
    StepDecl,
    TieDecl,
    parse_axis,
)
from .steps import validate_step
from .templates import BRACED, captures_of
from .write import dump_spec
from .yamlsrc import KeyPath, Source, decode_spec, load_source, spec_error

__all__ = ["dump_spec", "load_spec", "loads_spec"]  # dump_spec: the writer, in .write

FORMAT_VERSION = 1
TOP_KEYS = ("symspec", "name", "description", "models", "outputs", "dims", "spaces", "params", "ties", "canonicalize")
_SPACE_KEY = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)(?:\[([A-Za-z_][A-Za-z0-9_]*)\])?$")


def loads_spec(text: str, file: str = "<string>") -> Spec:
    """Parse a spec from YAML text (``file`` is used in error messages)."""
    src = load_source(text, file)
    spec = _structure(src)
    if src.diagnostics or spec is None:
        raise spec_error(file, src.diagnostics)
    return spec


def load_spec(source: str | Path) -> Spec:
    """Load a spec from a file path, or a built-in spec by name (see ``symspec specs``).
    Errors in a built-in spec cite it as ``builtin:NAME:LINE:COL`` (its file lives
    inside the installed package, at :func:`~symspec.spec.builtin_path`).

    >>> load_spec("nanogpt").name
    'nanogpt'
    >>> load_spec("nanogpt").source
    'builtin:nanogpt'
    """
    p = Path(source)
    # a folder is never a spec: one named like a built-in spec (a model folder 'llama' in
    # the working folder) does not hide that spec
    folder_named_builtin = p.is_dir() and builtin_path(str(source)) is not None
    if not folder_named_builtin and (p.suffix in (".yaml", ".yml") or p.exists()):
        # a regular file of a sane size: /dev/zero or a FIFO once ran until memory ran out
        data = read_small_file(source, "spec file", error=lambda message: SpecError([], headline=message))
        return loads_spec(decode_spec(data, str(source)), str(source))
    path = builtin_path(str(source))
    if path is None:
        hint = suggest(str(source), builtin_names())
        raise SpecError([], headline=f"'{source}' is neither a spec file nor a built-in spec" + (f"; {hint}" if hint else f"; built-in: {', '.join(builtin_names())}"))
    return loads_spec(path.read_text(encoding="utf-8"), f"{BUILTIN_PREFIX}{path.stem}")


# ---------------------------------------------------------------------------------------


def check_template(src: Source, template: str, path: KeyPath) -> bool:
    ok = True
    for m in BRACED.finditer(template):
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", m.group(1)):
            src.error(path, f"'{{{m.group(1)}}}' in '{template}' is not a valid capture (use e.g. {{i}})")
            ok = False
    stripped = BRACED.sub("", template)
    if "{" in stripped or "}" in stripped:
        src.error(path, f"unbalanced braces in parameter name '{template}'")
        ok = False
    if not template.strip():
        src.error(path, "empty parameter name")
        ok = False
    return ok


def _structure(src: Source) -> Spec | None:
    data = src.data
    if data is None:
        src.error((), "the spec is empty")
        return None
    if not isinstance(data, dict):
        src.error((), "a spec is a mapping with keys " + ", ".join(TOP_KEYS))
        return None
    for key in data:
        if key not in TOP_KEYS:
            src.error((key,), f"unknown key '{key}'", src.suggest(str(key), TOP_KEYS), at_key=True)
    version = data.get("symspec")
    if version is None:
        src.error((), f"missing 'symspec: {FORMAT_VERSION}' (the format version)")
    elif version != FORMAT_VERSION:
        src.error(("symspec",), f"unsupported format version {version!r}; this symspec reads version {FORMAT_VERSION}")
    name = data.get("name")
    if not isinstance(name, str) or not name:
        src.error(("name",) if "name" in data else (), "the spec needs a 'name' (a string)")
        name = "?"
    description = data.get("description", "")
    if not isinstance(description, str):
        src.error(("description",), "description must be a string")
        description = ""
    models = data.get("models", [])
    if isinstance(models, str):
        models = [models]
    if not isinstance(models, list) or not all(isinstance(m, str) for m in models):
        src.error(("models",), "models must be a list of model class names")
        models = []

    outputs = data.get("outputs", [])
    if isinstance(outputs, str):
        outputs = [outputs]
    if not isinstance(outputs, list) or not all(isinstance(o, str) and o for o in outputs) \
            or len(set(outputs)) != len(outputs):
        src.error(("outputs",), "outputs must be a list of distinct output names (keys of the model's output, e.g. logits)")
        outputs = []

    dims = _dims(src, data.get("dims", {}))
    # a declared dimension whose expression is wrong is still declared: its uses are not
    # reported again as unknown
    raw_dims = data.get("dims")
    dim_names = {d.name for d in dims} | ({k for k in raw_dims if isinstance(k, str) and k.isidentifier()}
                                          if isinstance(raw_dims, dict) else set())
    spaces, groups = _spaces(src, data.get("spaces"), dim_names)
    params = _params(src, data.get("params"), {s.name: s for s in spaces}, groups, dim_names)
    _check_bound(src, spaces, params)
    ties = _ties(src, data.get("ties", []))
    steps = _steps(src, data.get("canonicalize", []))
    return Spec(
        name=name,
        version=FORMAT_VERSION,
        description=description,
        models=tuple(models),
        outputs=tuple(outputs),
        dims=tuple(dims),
        spaces=tuple(spaces),
        params=tuple(params),
        ties=tuple(ties),
        canonicalize=tuple(steps),
        source=src.file,
    )


def _check_bound(src: Source, spaces: list[SpaceDecl], params: list[ParamDecl]) -> None:
    """Every declared space is bound to some parameter's axis: a space nothing binds acts
    on nothing, and its check (no row) would pass without testing it (a Falcon draft
    declared head maps that no parameter carried, and passed). Only where the params
    section parsed without errors (an axis that did not parse names nothing)."""
    if src.diagnostics:
        return
    used = {s for p in params for s in p.spaces}
    for sp in spaces:
        if sp.name not in used:
            src.error(("spaces", sp.key), f"space '{sp.key}' is declared but no parameter is bound to it, so nothing would "
                      "check it", "bind it on the axes it acts on under params, or remove it", at_key=True)


def _dims(src: Source, raw: Any) -> list[DimDecl]:
    if raw in (None, {}):
        return []
    if not isinstance(raw, dict):
        src.error(("dims",), "dims must be a mapping: name -> expression (e.g. d: config.n_embd)")
        return []
    out = []
    parsed: dict[str, ast.expr] = {}
    dim_keys = [k for k in raw if isinstance(k, str)]
    declared = set(raw)
    for name, expr in raw.items():
        path = ("dims", name)
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name) or name == "config":
            src.error(path, f"'{name}' is not a valid dimension name", at_key=True)
            continue
        if keyword.iskeyword(name):  # expressions are Python's: 'S(as)' would not parse
            src.error(path, f"'{name}' is a Python keyword, which a group or dimension expression cannot name; "
                      "use another name", at_key=True)
            continue
        try:
            node = parse_expr(expr)
        except ExprError as e:
            src.error(path, str(e))
            continue
        unknown = _names(node) - declared
        for n in sorted(unknown):
            src.error(path, f"unknown dimension '{n}'", src.suggest(n, dim_keys))
        problems = static_errors(node)
        for problem in problems:
            src.error(path, problem)
        value = None if problems else literal_value(node)
        if value is not None and value <= 0:
            src.error(path, f"dimension {name} is {value}; a dimension is a positive integer (a size)")
        parsed[name] = node
        out.append(DimDecl(name, str(expr), src.loc(path)))
    names = set(parsed)
    for cycle in _dim_cycles({name: _names(node) & names for name, node in parsed.items()}):
        ring = [*cycle, cycle[0]] if len(cycle) <= 8 else [*cycle[:4], "...", *cycle[-2:], cycle[0]]
        size = f" ({len(cycle)} dimensions)" if len(cycle) > 8 else ""
        src.error(("dims", cycle[0]), "circular dimensions: " + " -> ".join(ring) + size,
                  "a dimension cannot depend on itself, directly or through others")
    return out


def _dim_cycles(deps: dict[str, set[str]]) -> list[list[str]]:
    """Each cycle of the dependency graph once, starting at its first-declared member
    (``deps`` in declaration order). Iterative: a spec may declare many dimensions."""
    order = {name: i for i, name in enumerate(deps)}
    waiting = {name: len(d) for name, d in deps.items()}
    readers: dict[str, list[str]] = {name: [] for name in deps}
    for name, d in deps.items():
        for dep in d:
            readers[dep].append(name)
    ready = [name for name, n in waiting.items() if n == 0]
    while ready:  # peel off what evaluates; the rest sits on a cycle or depends on one
        for reader in readers[ready.pop()]:
            waiting[reader] -= 1
            if waiting[reader] == 0:
                ready.append(reader)
    stuck = [name for name in deps if waiting[name] > 0]
    seen: set[str] = set()
    cycles = []
    for start in stuck:  # every stuck name has a stuck dependency: follow them to a repeat
        path: list[str] = []
        at: dict[str, int] = {}
        cur = start
        while cur not in at and cur not in seen:
            at[cur] = len(path)
            path.append(cur)
            cur = min((d for d in deps[cur] if waiting[d] > 0), key=order.__getitem__)
        seen.update(path)
        if cur in at:  # a new cycle (else the walk reached one found before)
            cycle = path[at[cur]:]
            first = min(range(len(cycle)), key=lambda i: order[cycle[i]])
            cycles.append(cycle[first:] + cycle[:first])
    return cycles


def _names(node: ast.expr) -> set[str]:
    return names_in(node)


def _group_expr(src: Source, path: KeyPath, text: Any, dim_names: set[str]) -> GroupExpr | None:
    """Validate a space's group text as far as it goes without a model: every group kind,
    argument and option, and the dimensions it reads. Its symbolic form, or None."""
    if not isinstance(text, str):
        src.error(path, f"a group is written like 'S(n)' or 'Heads(H, qk=GL(dh), ov=GL(dh))', got {text!r}")
        return None
    try:
        expr = parse_group_expr(text)
    except UnknownGroupError as e:
        for kind in e.kinds:
            src.error(path, f"unknown group '{kind}'", src.suggest(kind, REGISTRY, aliases=ALIASES) or f"known: {', '.join(sorted(REGISTRY))}")
        return None
    except (GroupError, ExprError) as e:
        src.error(path, str(e))
        return None
    for n in sorted(expr.names - dim_names):
        src.error(path, f"unknown dimension '{n}' in group '{text}'", src.suggest(n, dim_names))
    return expr


def _spaces(src: Source, raw: Any, dim_names: set[str]) -> tuple[list[SpaceDecl], dict[str, GroupExpr | None]]:
    """The declared spaces, and each one's group in symbolic form (None where it is wrong)."""
    if raw is None:
        src.error((), "the spec declares no 'spaces'")
        return [], {}
    if not isinstance(raw, dict):
        src.error(("spaces",), "spaces must be a mapping: name or name[i] -> group")
        return [], {}
    out = []
    groups: dict[str, GroupExpr | None] = {}
    seen: set[str] = set()
    for key, value in raw.items():
        path: KeyPath = ("spaces", key)
        m = _SPACE_KEY.match(str(key))
        if not m:
            src.error(path, f"'{key}' is not a space name (write 'resid' or, per layer, 'ff[i]')", at_key=True)
            continue
        name, index = m.group(1), m.group(2)
        if name in seen:
            src.error(path, f"space '{name}' is declared twice")
            continue
        seen.add(name)
        doc = ""
        gpath = path
        if isinstance(value, dict):
            for k in value:
                if k not in ("group", "doc"):
                    src.error((*path, k), f"a space has no field '{k}'", src.suggest(str(k), ["group", "doc"]), at_key=True)
            doc = str(value.get("doc", ""))
            gpath = (*path, "group")
            if "group" not in value:
                src.error(path, "the space needs a 'group'")
                continue
            value = value["group"]
        groups[name] = _group_expr(src, gpath, value, dim_names)
        if not isinstance(value, str):
            continue
        out.append(SpaceDecl(name, index, value, doc, src.loc(gpath)))  # the group's position
    return out, groups


def _params(src: Source, raw: Any, spaces: dict[str, SpaceDecl], groups: dict[str, GroupExpr | None],
            dim_names: set[str]) -> list[ParamDecl]:
    if raw is None:
        src.error((), "the spec declares no 'params'")
        return []
    if not isinstance(raw, dict):
        src.error(("params",), "params must be a mapping: parameter name template -> axes or 'invariant'")
        return []
    out = []
    for pattern, value in raw.items():
        path: KeyPath = ("params", pattern)
        if not isinstance(pattern, str) or not check_template(src, pattern, path):
            continue
        caps = captures_of(pattern)
        if len(set(caps)) != len(caps):
            src.error(path, f"'{pattern}' captures the same name twice")
            continue
        doc = ""
        view: tuple[tuple[int, ...], ...] | None = None
        if isinstance(value, dict):
            for k in value:
                if k not in PARAM_FIELDS:
                    src.error((*path, k), f"a parameter has no field '{k}'", src.suggest(str(k), PARAM_FIELDS), at_key=True)
            doc = str(value.get("doc", ""))
            if "view" in value:
                view = _view(src, (*path, "view"), value["view"])
                if view is None:
                    continue
            if value.get("invariant") is True:
                if "axes" in value:
                    src.error(path, "a parameter is either invariant or has axes, not both")
                if "view" in value:
                    src.error((*path, "view"), "an invariant parameter has no view: a view says how bound axes see the tensor")
                value = "invariant"
            elif "axes" in value:
                path = (*path, "axes")
                value = value["axes"]
            else:
                src.error(path, "give 'axes: [...]' or 'invariant: true'")
                continue
        if value == "invariant":
            out.append(ParamDecl(pattern, None, True, doc, src.loc(("params", pattern), at_key=True)))
            continue
        if isinstance(value, str):
            hint = src.suggest(value, ["invariant"])
            src.error(path, f"expected a list of axes or 'invariant', got '{value}'", hint)
            continue
        if not isinstance(value, list) or not value:
            src.error(path, "expected a list with one axis expression per axis (use _ for an untouched axis), or 'invariant'")
            continue
        axes: list[AxisExpr | None] = []
        locs = []
        unparsed = False
        for i, item in enumerate(value):
            apath = (*path, i)
            locs.append(src.loc(apath))
            try:
                ax = parse_axis(item)
            except AxisSyntaxError as e:
                src.error(apath, f"cannot parse axis '{item}' at column {e.column}: {e}")
                axes.append(None)
                unparsed = True
                continue
            if ax is not None:
                _check_terms(src, apath, ax, caps, spaces, groups)
                if isinstance(ax.heads, str) and ax.heads not in dim_names:
                    src.error(apath, f"'{ax}': unknown dimension '{ax.heads}' in heads=", suggest(ax.heads, dim_names) or (f"dims: {', '.join(sorted(dim_names))}" if dim_names else "declare it under dims"))
            axes.append(ax)
        if all(a is None for a in axes):
            if not unparsed:  # an axis that did not parse is reported already
                src.error(path, "no axis is bound to a space; declare the parameter 'invariant' instead")
            continue
        if view is not None and len(view) != len(axes):
            src.error(path, f"the view {_view_text(view)} has {len(view)} axes, the list gives {len(axes)}: one axis expression per viewed axis")
            continue
        out.append(ParamDecl(pattern, tuple(axes), False, doc, src.loc(("params", pattern), at_key=True), tuple(locs), view))
    return out


#: the fields of a parameter written as a mapping
PARAM_FIELDS = ("axes", "invariant", "doc", "view")


def _view(src: Source, path: KeyPath, raw: Any) -> tuple[tuple[int, ...], ...] | None:
    """``view: [[0, 1], 2]``: the stored axes each bound axis sees, merged row-major."""
    usage = "a view lists, per bound axis, a stored axis or a list of stored axes merged into it (e.g. [[0, 1], 2])"
    if not isinstance(raw, list) or not raw:
        src.error(path, usage)
        return None
    out = []
    for item in raw:
        group = item if isinstance(item, list) else [item]
        if not group or not all(isinstance(a, int) and not isinstance(a, bool) and a >= 0 for a in group):
            src.error(path, usage + f"; got {raw!r}")
            return None
        out.append(tuple(group))
    flat = sorted(a for g in out for a in g)
    if flat != list(range(len(flat))):
        src.error(path, f"a view names every stored axis exactly once (0 to {len(flat) - 1}), got {raw!r}")
        return None
    return tuple(out)


def _view_text(view: tuple[tuple[int, ...], ...]) -> str:
    return "[" + ", ".join(str(g[0]) if len(g) == 1 else "[" + ", ".join(map(str, g)) + "]" for g in view) + "]"


def _check_terms(src: Source, path: KeyPath, ax: AxisExpr, caps: tuple[str, ...], spaces: dict[str, SpaceDecl],
                 groups: dict[str, GroupExpr | None]) -> None:
    for term in ax.terms():
        decl = spaces.get(term.space)
        if decl is None:
            src.error(path, f"unknown space '{term.space}'", src.suggest(term.space, spaces) or (f"declared: {', '.join(spaces)}" if spaces else None))
            continue
        if decl.index and term.index is None:
            src.error(path, f"space '{term.space}' is per layer ({decl.key}); write {term.space}[{decl.index}]")
        if not decl.index and term.index is not None:
            src.error(path, f"space '{term.space}' has no layer index; write {term.space}")
        if isinstance(term.index, str) and term.index not in caps:
            src.error(path, f"'{term.ref}' uses '{{{term.index}}}', which '{path[1]}' does not capture", f"captures: {', '.join(caps) or 'none'}")
        group = groups.get(term.space)
        if group is not None and term.path not in group.rep_paths():
            valid = [".".join(p) for p in group.rep_paths() if p]
            want = ".".join(term.path)
            src.error(path, f"'{term.ref}': {decl.group} has no representation '{want}'", src.suggest(want, valid) or (f"valid: {', '.join(valid)}" if valid else "it takes no part name"))


def _ties(src: Source, raw: Any) -> list[TieDecl]:
    if raw in (None, []):
        return []
    if not isinstance(raw, list):
        src.error(("ties",), "ties must be a list of lists of parameter names")
        return []
    out = []
    for i, item in enumerate(raw):
        path = ("ties", i)
        if not isinstance(item, list) or len(item) < 2 or not all(isinstance(x, str) for x in item):
            src.error(path, "a tie is a list of two or more parameter names")
            continue
        if not all(check_template(src, x, path) for x in item):
            continue
        caps = {frozenset(captures_of(x)) for x in item}
        if len(caps) > 1:
            src.error(path, "tied names must capture the same variables")
            continue
        out.append(TieDecl(tuple(item), src.loc(path)))
    return out


def _steps(src: Source, raw: Any) -> list[StepDecl]:
    if raw in (None, []):
        return []
    if not isinstance(raw, list):
        src.error(("canonicalize",), "canonicalize must be a list of steps")
        return []
    out = []
    for i, item in enumerate(raw):
        path = ("canonicalize", i)
        res = validate_step(src, path, item, lambda t, p: check_template(src, t, p))
        if res is None:
            continue
        kind, args = res
        out.append(StepDecl.make(kind, args, src.loc(path)))
    return out
