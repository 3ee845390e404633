"""Binding a spec to a model: resolve every name template, shape and space.

``bind(spec, model)`` refuses, with every problem located in the spec file:
a binding that matches no parameter, a shape that contradicts the declared dimensions,
a parameter the spec does not account for, tied parameters that the groups would
untie. The result, :class:`BoundSpec`, carries the typed :class:`~symspec.problem.Problem`
that transforms and solvers use, the concrete canonicalisation steps, and the model's
graph when it could be traced.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Mapping
from typing import Any

import attrs
import torch

from .errors import BindError, Diagnostic, GroupError, Location, suggest
from .groups import Group
from .groups import parse as parse_group
from .problem import AxisBinding, Factor, HeadMajor, ParamBinding, Problem, Segment, SpaceInstance
from .spec.exprs import DimContext, ExprError, evaluate_dims, parse_expr
from .spec.load import captures_of
from .spec.model import ParamDecl, Spec, StepDecl

_CAPTURE = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*)\}")


@attrs.frozen
class CanonOp:
    """A canonicalisation step with concrete parameter names."""

    kind: str
    args: Mapping[str, Any]
    loc: Location = attrs.field(default=Location(), eq=False, repr=False)
    #: the index of the spec's step it comes from (one step makes one op per match)
    step: int = attrs.field(default=-1, eq=False, repr=False)


@attrs.define
class BoundSpec:
    spec: Spec
    problem: Problem
    dims: dict[str, int]
    canonical: tuple[CanonOp, ...]
    shapes: dict[str, tuple[int, ...]]
    #: tie groups of the model as given (before canonicalisation)
    model_ties: tuple[tuple[str, ...], ...] = ()
    model_class: str = ""
    graph: Any = None  # symspec.graph.ModelGraph when traced

    @property
    def spaces(self) -> dict[str, SpaceInstance]:
        return self.problem.spaces


def template_regex(template: str) -> re.Pattern[str]:
    out = []
    pos = 0
    for m in _CAPTURE.finditer(template):
        out.append(re.escape(template[pos : m.start()]))
        out.append(f"(?P<{m.group(1)}>\\d+)")
        pos = m.end()
    out.append(re.escape(template[pos:]))
    return re.compile("".join(out))


def fill(template: str, captures: Mapping[str, Any]) -> str:
    return _CAPTURE.sub(lambda m: str(captures[m.group(1)]), template)


def named_tensors(model: torch.nn.Module | Mapping[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], list[tuple[str, ...]]]:
    """Floating-point state entries and the groups of names that share storage."""
    if isinstance(model, torch.nn.Module):
        sd = model.state_dict(keep_vars=True)
    else:
        sd = dict(model)
    tensors = {k: v for k, v in sd.items() if isinstance(v, torch.Tensor) and v.is_floating_point()}
    groups: dict[tuple[Any, ...], list[str]] = defaultdict(list)
    for k, v in tensors.items():
        if v.numel() == 0:
            continue
        try:
            key = (v.untyped_storage().data_ptr(), v.storage_offset(), tuple(v.shape), tuple(v.stride()), v.device)
        except (RuntimeError, NotImplementedError):  # meta / fake tensors
            key = (id(v),)
        groups[key].append(k)
    ties = [tuple(g) for g in groups.values() if len(g) > 1]
    return tensors, ties


def model_config(model: Any) -> Any:
    return getattr(model, "config", None)


def bind(spec: Spec, model: torch.nn.Module | Mapping[str, torch.Tensor], *, config: Any = None,
         example_inputs: Any = None, trace: bool = False) -> BoundSpec:
    """Bind ``spec`` to a model (or a state dict plus its ``config``).

    With ``trace=True`` and example inputs, the model is traced into a graph
    (:func:`symspec.graph.trace`) whose nodes carry the activation sites of each space.
    """
    diags: list[Diagnostic] = []
    tensors, ties = named_tensors(model)
    shapes = {k: tuple(v.shape) for k, v in tensors.items()}
    cls_name = type(model).__name__ if isinstance(model, torch.nn.Module) else "state dict"
    if config is None and isinstance(model, torch.nn.Module):
        config = model_config(model)

    # -- dimensions -------------------------------------------------------------------
    exprs = {}
    for d in spec.dims:
        try:
            exprs[d.name] = parse_expr(d.expr)
        except ExprError as e:
            diags.append(Diagnostic(d.loc, str(e)))
    module = model if isinstance(model, torch.nn.Module) else None
    dims, errors = evaluate_dims(exprs, DimContext({}, config, shapes, module))
    for d in spec.dims:
        if d.name in errors:
            diags.append(Diagnostic(d.loc, f"dimension {d.name} = {d.expr}: {errors[d.name]}"))

    # -- groups of the declared spaces ----------------------------------------------------
    groups: dict[str, Group] = {}
    for s in spec.spaces:
        try:
            groups[s.name] = parse_group(s.group, dims=lambda node: DimContext(dims, config, shapes, module).evaluate(parse_expr(_unparse(node))))
        except (GroupError, ExprError) as e:
            diags.append(Diagnostic(s.loc, f"space {s.key}: group {s.group}: {e}"))

    # -- parameters ------------------------------------------------------------------------
    owner: dict[str, ParamDecl] = {}
    matches: dict[ParamDecl, list[tuple[str, dict[str, int]]]] = {}
    hint = _HintBudget()
    unmatched: list[ParamDecl] = []
    for decl in spec.params:
        found = []
        if not decl.captures:  # a plain name: a lookup, not a scan (specs may list many)
            if decl.pattern in tensors:
                found.append((decl.pattern, {}))
        else:
            rx = template_regex(decl.pattern)
            for name in tensors:
                m = rx.fullmatch(name)
                if m:
                    found.append((name, {k: int(v) for k, v in m.groupdict().items()}))
        if not found:
            unmatched.append(decl)
            if len(unmatched) <= MAX_UNMATCHED_SHOWN:
                guess = fill(decl.pattern, {c: 0 for c in decl.captures})
                diags.append(Diagnostic(decl.loc, f"'{decl.pattern}' matches no parameter of {cls_name}", hint(guess, tensors, n=3)))
            continue
        matches[decl] = found
        for name, _ in found:
            if name in owner:
                diags.append(Diagnostic(decl.loc, f"'{name}' is matched by both '{owner[name].pattern}' and '{decl.pattern}'"))
            owner[name] = decl

    if len(unmatched) > MAX_UNMATCHED_SHOWN:
        rest = unmatched[MAX_UNMATCHED_SHOWN:]
        shown = ", ".join(f"'{d.pattern}'" for d in rest[:3]) + (", ..." if len(rest) > 3 else "")
        diags.append(Diagnostic(rest[0].loc, f"{len(rest)} more parameter template(s) match no parameter of {cls_name}: {shown}"))

    spaces: dict[str, SpaceInstance] = {}
    params: dict[str, ParamBinding] = {}
    invariants: list[str] = []
    space_decls = {s.name: s for s in spec.spaces}
    for decl, found in matches.items():
        for name, caps in found:
            if decl.invariant:
                invariants.append(name)
                continue
            pb = _bind_param(decl, name, caps, shapes[name], space_decls, groups, spaces, diags, dims)
            if pb is not None:
                params[name] = pb

    # -- every parameter accounted for ----------------------------------------------------
    tied_to: dict[str, tuple[str, ...]] = {n: g for g in ties for n in g}
    unbound = [n for n in tensors if n not in owner]
    if unbound:
        shown = ", ".join(unbound[:8]) + (f" and {len(unbound) - 8} more" if len(unbound) > 8 else "")
        diags.append(Diagnostic(Location(spec.source, 0, 0, "params"),
                                f"{len(unbound)} parameter(s) of {cls_name} are neither bound nor declared invariant: {shown}",
                                "a spec must account for every parameter: bind it to a space or declare it 'invariant'"))

    # -- ties -----------------------------------------------------------------------------
    untied = {fill_name for step in spec.canonicalize if step.kind == "untie" for fill_name in _expand_simple(step.arg("param"), tensors)}
    declared: list[tuple[str, ...]] = []
    for t in spec.ties:
        rx = template_regex(t.params[0])
        found_any = False
        for name in tensors:
            m = rx.fullmatch(name)
            if not m:
                continue
            found_any = True
            caps = {k: int(v) for k, v in m.groupdict().items()}
            names = tuple(fill(p, caps) for p in t.params)
            missing = [n for n in names if n not in tensors]
            if missing:
                diags.append(Diagnostic(t.loc, f"tied parameter(s) {', '.join(missing)} not in {cls_name}", hint(missing[0], tensors)))
                continue
            declared.append(names)
            really = all(tied_to.get(n) is not None and set(names) <= set(tied_to[n]) for n in names)
            if not really and isinstance(model, torch.nn.Module) and not (set(names) & untied):
                diags.append(Diagnostic(t.loc, f"{' and '.join(names)} are declared tied, but {cls_name} stores them separately"))
            _check_tie(names, params, spaces, untied, t.loc, diags)
        if not found_any:
            diags.append(Diagnostic(t.loc, f"'{t.params[0]}' matches no parameter of {cls_name}", hint(fill(t.params[0], {c: 0 for c in captures_of(t.params[0])}), tensors)))
    declared_sets = [set(d) for d in declared]
    for g in ties:
        if not any(set(g) <= d for d in declared_sets):
            diags.append(Diagnostic(Location(spec.source, 0, 0, "ties"), f"{cls_name} ties {' and '.join(g)} (one shared tensor), but the spec does not declare it",
                                    f"add '- [{', '.join(g)}]' under ties"))

    # -- canonicalisation steps -----------------------------------------------------------
    canonical = _bind_steps(spec.canonicalize, tensors, shapes, declared, diags, hint)
    if diags:
        raise BindError(diags, headline=_misfit_headline(spec, cls_name, len(spec.params) - len(unmatched), len(diags), tensors))

    after_untie = tuple(g for g in declared if not (set(g) & untied))
    problem = Problem(spaces=spaces, params=params, invariants=tuple(invariants), ties=after_untie)
    bound = BoundSpec(spec, problem, dims, canonical, shapes, tuple(declared), cls_name)
    if trace and isinstance(model, torch.nn.Module) and example_inputs is not None:
        from .graph import trace as trace_model

        bound.graph = trace_model(model, example_inputs, bound.problem)
    return bound


#: unmatched parameter templates listed one by one, each with a "did you mean" (difflib
#: against every parameter name, about a millisecond each); the rest are counted in one line
MAX_UNMATCHED_SHOWN = 20
#: "did you mean" hints computed per binding (unmatched ties and steps too): a spec with
#: a million wrong names must not take a million fuzzy searches
MAX_HINTS = 50


class _HintBudget:
    """:func:`~symspec.errors.suggest` for the first :data:`MAX_HINTS` calls, then None."""

    def __init__(self) -> None:
        self.left = MAX_HINTS

    def __call__(self, name: str, candidates: Mapping[str, Any], n: int = 1) -> str | None:
        if self.left <= 0:
            return None
        self.left -= 1
        return suggest(name, candidates, n=n)


def _misfit_headline(spec: Spec, cls_name: str, matched: int, problems: int, tensors: Mapping[str, Any]) -> str:
    """The first line of a binding error: how much of the spec fits at all, and which
    built-in spec would (``--spec gpt2`` on a Llama reports ~40 problems; the fix is one)."""
    from .spec.builtin import BUILTIN_PREFIX, specs_for_class

    total = len(spec.params)
    line = (f"{spec.source}: the spec '{spec.name}' does not fit {cls_name}: "
            f"{matched} of its {total} parameter template(s) match a parameter ({problems} problem(s))")
    poor = matched * 2 < total
    # a built-in spec that fits the class; not this spec itself, nor for a user's edited
    # copy of it (same name, mostly matching), whose fix is in the file
    fits = [n for n in specs_for_class(cls_name) if spec.source != f"{BUILTIN_PREFIX}{n}" and (poor or n != spec.name)]
    if fits:
        which = ", ".join(f"'{n}'" for n in fits)
        return line + f"; the built-in spec {which} fits {cls_name}: --spec {fits[0]}"
    if poor:  # and no class to go by: try the built-ins' parameter names
        named = _builtin_naming(tensors, exclude=spec.source)
        if len(named) == 1:
            return line + f"; the built-in spec '{named[0]}' names these parameters: --spec {named[0]}"
        if named:  # the names alone do not tell these apart (Llama and Gemma name theirs alike)
            return line + f"; the built-in specs {', '.join(repr(n) for n in named)} name these parameters: --spec NAME"
    return line


def _builtin_naming(tensors: Mapping[str, Any], exclude: str) -> list[str]:
    """The built-in specs all of whose parameter templates match these parameters (for a
    state dict, or a class no spec lists)."""
    from .errors import SymspecInputError
    from .spec.builtin import BUILTIN_PREFIX, builtin_names
    from .spec.load import load_spec

    out = []
    for name in builtin_names():
        if exclude == f"{BUILTIN_PREFIX}{name}":
            continue
        try:
            spec = load_spec(name)
        except SymspecInputError:  # pragma: no cover - the built-in specs are validated by the tests
            continue
        rxs = [template_regex(p.pattern) for p in spec.params]
        if rxs and all(any(rx.fullmatch(t) for t in tensors) for rx in rxs):
            out.append(name)
    return out


def _unparse(node: Any) -> str:
    import ast

    return ast.unparse(node)


def _expand_simple(template: str | None, tensors: Mapping[str, Any]) -> list[str]:
    if not template:
        return []
    rx = template_regex(template)
    return [n for n in tensors if rx.fullmatch(n)]


def _bind_param(decl: ParamDecl, name: str, caps: dict[str, int], shape: tuple[int, ...],
                space_decls: dict[str, Any], groups: dict[str, Group], spaces: dict[str, SpaceInstance],
                diags: list[Diagnostic], dims: Mapping[str, int] | None = None) -> ParamBinding | None:
    axes_decl = decl.axes or ()
    if len(axes_decl) != len(shape):
        diags.append(Diagnostic(decl.loc, f"{name} has {len(shape)} axes (shape {list(shape)}), the spec gives {len(axes_decl)}"))
        return None
    bindings = []
    ok = True
    for axis, expr in enumerate(axes_decl):
        if expr is None:
            continue
        loc = decl.axis_locs[axis] if axis < len(decl.axis_locs) else decl.loc
        segments = []
        start = 0
        sizes = []
        for chain in expr.segments:
            factors = []
            size = None
            for term in chain.terms:
                sdecl = space_decls.get(term.space)
                group = groups.get(term.space)
                if sdecl is None or group is None:
                    ok = False
                    continue
                idx = caps[term.index] if isinstance(term.index, str) else term.index
                inst_name = f"{term.space}[{idx}]" if sdecl.index else term.space
                if inst_name not in spaces:
                    spaces[inst_name] = SpaceInstance(inst_name, term.space, idx if sdecl.index else None, group, sdecl.loc)
                try:
                    tsize = group.rep_size(term.path)
                except GroupError as e:
                    diags.append(Diagnostic(loc, f"{name}: {e}"))
                    ok = False
                    continue
                if size is not None and tsize != size:
                    diags.append(Diagnostic(loc, f"{name}: '{chain}' composes representations of sizes {size} and {tsize}"))
                    ok = False
                size = tsize
                factors.append(Factor(inst_name, term.path, term.variance))
            if size is None:
                continue
            sizes.append(size)
            segments.append(Segment(start, size, tuple(factors)))
            start += size
        if not ok:
            continue
        if start != shape[axis]:
            parts = " + ".join(str(s) for s in sizes)
            detail = f" = {parts}" if len(sizes) > 1 else ""
            used = dict.fromkeys(f.space for seg in segments for f in seg.factors)
            groups_txt = ", ".join(f"{u}: {spaces[u].group}" for u in used)
            diags.append(Diagnostic(loc, f"{name}: axis {axis} has size {shape[axis]}, but '{expr}' ({groups_txt}) expects {start}{detail}",
                                    _kv_hint(expr, shape[axis], groups) or "the shape contradicts the declared dimensions; check dims and groups"))
            ok = False
            continue
        layout = None
        if expr.heads is not None:
            layout = _head_major(expr, name, sizes, dims or {}, loc, diags)
            if layout is None:
                ok = False
                continue
        bindings.append(AxisBinding(axis, tuple(segments), layout))
    if not ok:
        return None
    return ParamBinding(name, tuple(shape), tuple(bindings), decl.loc)


def _head_major(expr: Any, name: str, sizes: list[int], dims: Mapping[str, int], loc: Location,
                diags: list[Diagnostic]) -> HeadMajor | None:
    """The index map of ``cat(..., heads=H)``: every part splits into H equal head slices."""
    heads = expr.heads if isinstance(expr.heads, int) else dims.get(expr.heads)
    if heads is None:  # an unknown or failed dimension is reported where it is declared
        diags.append(Diagnostic(loc, f"{name}: '{expr}': the dimension '{expr.heads}' has no value"))
        return None
    if heads < 1 or any(s % heads for s in sizes):
        diags.append(Diagnostic(loc, f"{name}: '{expr}': parts of sizes {', '.join(map(str, sizes))} do not split into "
                                     f"heads={expr.heads} ({heads}) equal head slices",
                                "heads= counts the blocks of the stored layout: each part holds one slice per block"))
        return None
    return HeadMajor(heads, tuple(s // heads for s in sizes))


def _kv_hint(expr: Any, size: int, groups: Mapping[str, Group]) -> str | None:
    """Grouped-query attention: a key/value projection bound to the query-head view."""
    terms = expr.terms()
    if len(expr.segments) != 1 or len(terms) != 1:
        return None
    t = terms[0]
    g = groups.get(t.space)
    kv_path = (*t.path, "kv")
    if g is None or "kv" in t.path or kv_path not in g.rep_paths() or g.rep_size(kv_path) != size:
        return None
    return f"its size is that of the key/value-head view: did you mean '{attrs.evolve(t, path=kv_path)}'?"


def _transform_signature(pb: ParamBinding | None, spaces: Mapping[str, SpaceInstance]) -> tuple[Any, ...]:
    """What transform a binding asks for, with co == contra for orthogonal representations."""
    if pb is None:
        return ()
    out = []
    for a in pb.axes:
        segs = []
        for s in a.segments:
            fs = []
            for f in s.factors:
                v = f.variance
                if v == "contra" and spaces[f.space].group.is_orthogonal(f.path):
                    v = "co"
                fs.append((f.space, f.path, v))
            segs.append((s.start, s.size, tuple(fs)))
        out.append((a.axis, tuple(segs), a.layout))
    return tuple(out)


def _check_tie(names: tuple[str, ...], params: Mapping[str, ParamBinding], spaces: Mapping[str, SpaceInstance],
               untied: set[str], loc: Location, diags: list[Diagnostic]) -> None:
    if set(names) & untied:
        return
    sigs = {n: _transform_signature(params.get(n), spaces) for n in names}
    first = names[0]
    for n in names[1:]:
        if sigs[n] != sigs[first]:
            a = params.get(first)
            b = params.get(n)
            da = ", ".join(str(x) for x in a.axes) if a else "invariant"
            db = ", ".join(str(x) for x in b.axes) if b else "invariant"
            groups = sorted({str(spaces[f].group) for p in (a, b) if p for f in p.spaces()})
            diags.append(Diagnostic(loc, f"tied parameters {first} ({da}) and {n} ({db}) need different transforms under {', '.join(groups)}; "
                                          "the group would untie them",
                                    f"use a group whose representations are orthogonal, or declare '- untie: {n}' under canonicalize"))


def _bind_steps(steps: tuple[StepDecl, ...], tensors: Mapping[str, torch.Tensor], shapes: Mapping[str, tuple[int, ...]],
                ties: list[tuple[str, ...]], diags: list[Diagnostic], hint: _HintBudget | None = None) -> tuple[CanonOp, ...]:
    hint = hint or _HintBudget()
    out: list[CanonOp] = []
    untied: set[str] = set()
    tie_of = {n: g for g in ties for n in g}

    def touches_tie(name: str, loc: Location, what: str) -> None:
        g = tie_of.get(name)
        if g and name not in untied and not (set(g) - {name}) <= untied:
            others = ", ".join(x for x in g if x != name)
            diags.append(Diagnostic(loc, f"{what} changes {name}, which is tied to {others}; that would untie them",
                                    f"declare '- untie: {name}' before this step"))

    for step_index, step in enumerate(steps):
        args = step.as_dict()
        if step.kind == "untie":
            names = _expand_simple(args["param"], tensors)
            if not names:
                diags.append(Diagnostic(step.loc, f"untie: '{args['param']}' matches no parameter", hint(args["param"], tensors)))
            for n in names:
                if n not in tie_of:
                    diags.append(Diagnostic(step.loc, f"untie: {n} is not declared tied to anything"))
                untied.add(n)
                out.append(CanonOp("untie", {"param": n}, step.loc, step_index))
        elif step.kind == "fold_norm":
            rx = template_regex(args["gain"])
            found = [(n, {k: int(v) for k, v in m.groupdict().items()}) for n in tensors if (m := rx.fullmatch(n))]
            if not found:
                diags.append(Diagnostic(step.loc, f"fold_norm: '{args['gain']}' matches no parameter", hint(fill(args["gain"], {c: 0 for c in captures_of(args["gain"])}), tensors)))
            for gain, caps in found:
                bias = fill(args["bias"], caps) if args.get("bias") else None
                if bias is not None and bias not in tensors:
                    diags.append(Diagnostic(step.loc, f"fold_norm: no parameter {bias}", hint(bias, tensors)))
                    continue
                n = shapes[gain]
                if len(n) != 1:
                    diags.append(Diagnostic(step.loc, f"fold_norm: {gain} has shape {list(n)}; a norm gain is a vector"))
                    continue
                readers = []
                for r in args["into"]:
                    w = fill(r["weight"], caps)
                    rb = fill(r["bias"], caps) if r.get("bias") else None
                    if w not in tensors:
                        diags.append(Diagnostic(step.loc, f"fold_norm: no parameter {w}", hint(w, tensors)))
                        continue
                    ax = r["axis"]
                    if not -len(shapes[w]) <= ax < len(shapes[w]) or shapes[w][ax] != n[0]:
                        diags.append(Diagnostic(step.loc, f"fold_norm: axis {ax} of {w} (shape {list(shapes[w])}) does not have the norm's size {n[0]}"))
                        continue
                    if rb is not None and rb not in tensors:
                        diags.append(Diagnostic(step.loc, f"fold_norm: no parameter {rb}", hint(rb, tensors)))
                        continue
                    if rb is not None:
                        want = tuple(s for k, s in enumerate(shapes[w]) if k != ax % len(shapes[w]))
                        if tuple(shapes[rb]) != want:
                            diags.append(Diagnostic(step.loc, f"fold_norm: {rb} has shape {list(shapes[rb])}, but {w} without axis {ax} has {list(want)}; it is not that reader's bias"))
                            continue
                    if bias is not None and args.get("fold_bias", True) and rb is None:
                        diags.append(Diagnostic(step.loc, f"fold_norm: {w} has no bias to absorb {bias}",
                                                "set 'fold_bias: false' to keep the norm's bias (and bind it to the space)"))
                        continue
                    touches_tie(w, step.loc, "fold_norm")
                    if rb:
                        touches_tie(rb, step.loc, "fold_norm")
                    readers.append({"weight": w, "axis": ax % len(shapes[w]), "bias": rb})
                touches_tie(gain, step.loc, "fold_norm")
                op_args = {"gain": gain, "bias": bias, "fold_bias": bool(args.get("fold_bias", True)), "into": readers}
                if args.get("gain_offset"):  # only when set: records of plain folds stay as they were
                    op_args["gain_offset"] = args["gain_offset"]
                out.append(CanonOp("fold_norm", op_args, step.loc, step_index))
        elif step.kind == "center":
            writers = []
            for template, axis in args["writers"].items():
                names = _expand_simple(template, tensors)
                if not names:
                    diags.append(Diagnostic(step.loc, f"center: '{template}' matches no parameter", hint(fill(template, {c: 0 for c in captures_of(template)}), tensors)))
                for n in names:
                    if not -len(shapes[n]) <= axis < len(shapes[n]):
                        diags.append(Diagnostic(step.loc, f"center: {n} has no axis {axis} (shape {list(shapes[n])})"))
                        continue
                    touches_tie(n, step.loc, "center")
                    writers.append({"param": n, "axis": axis % len(shapes[n])})
            out.append(CanonOp("center", {"writers": writers}, step.loc, step_index))
        else:  # pragma: no cover - validated at load
            diags.append(Diagnostic(step.loc, f"unknown step {step.kind}"))
    return tuple(out)
