"""Binding a spec to a model: resolve every name template, shape and space.

``bind(spec, model)`` refuses, with every problem located in the spec file:
a binding that matches no parameter, a shape that contradicts the declared dimensions,
a parameter the spec does not account for, tied parameters that the groups would
untie. The result, :class:`BoundSpec`, carries the typed :class:`~symspec.problem.Problem`
that transforms and solvers use, the concrete canonicalisation steps, and the model's
graph when it could be traced.
"""

from __future__ import annotations

import os
from collections import defaultdict
from collections.abc import Mapping
from typing import Any

import attrs
import torch

from .canonical import STEPS, BindContext, CanonOp
from .errors import BindError, Diagnostic, GroupError, Location, SymspecInputError, suggest
from .graph import trace as trace_model
from .groups import Group
from .problem import (
    AxisBinding,
    AxisView,
    Factor,
    HeadMajor,
    ParamBinding,
    Problem,
    Segment,
    SpaceInstance,
)
from .spec.builtin import BUILTIN_PREFIX, builtin_names, specs_for_class
from .spec.exprs import DimContext, ExprError, evaluate_dims, parse_expr
from .spec.load import load_spec
from .spec.model import AxisExpr, Chain, ParamDecl, SpaceDecl, Spec
from .spec.templates import example_name, fill, matches, template_regex
from .statedict import storage_key

__all__ = ["MAX_HINTS", "MAX_UNMATCHED_SHOWN", "BoundSpec", "CanonOp", "bind", "fill", "named_tensors", "template_regex"]


@attrs.define
class BoundSpec:
    """A spec bound to one model: the typed problem, the dimensions' values, the concrete
    canonicalisation steps, and the traced graph when asked for."""

    spec: Spec
    problem: Problem
    dims: dict[str, int]
    canonical: tuple[CanonOp, ...]
    #: tie groups of the model as given (before canonicalisation)
    model_ties: tuple[tuple[str, ...], ...] = ()
    graph: Any = None  # symspec.graph.ModelGraph when traced

    @property
    def spaces(self) -> dict[str, SpaceInstance]:
        return self.problem.spaces


def named_tensors(model: torch.nn.Module | Mapping[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], list[tuple[str, ...]]]:
    """Floating-point state entries and the groups of names that share storage."""
    if isinstance(model, torch.nn.Module):
        sd = model.state_dict(keep_vars=True)
    else:
        sd = dict(model)
    tensors = {k: v for k, v in sd.items() if isinstance(v, torch.Tensor) and v.is_floating_point()}
    groups: dict[tuple[object, ...], list[str]] = defaultdict(list)
    for k, v in tensors.items():
        if v.numel() == 0:
            continue
        groups[storage_key(v)].append(k)
    ties = [tuple(g) for g in groups.values() if len(g) > 1]
    return tensors, ties


def bind(spec: Spec | str, model: torch.nn.Module | Mapping[str, torch.Tensor], *, config: Any = None,
         example_inputs: Any = None, trace: bool = False) -> BoundSpec:
    """Bind ``spec`` (a Spec, a spec file or a built-in name) to a model (or a state dict
    plus its ``config``).

    With ``trace=True`` and example inputs, the model is traced into a graph
    (:func:`symspec.graph.trace`) and the activation sites of each space are recorded on
    the problem (:attr:`~symspec.problem.Problem.sites`).
    """
    if not isinstance(spec, (Spec, str, os.PathLike)):
        raise TypeError(f"bind(spec, model): spec is a Spec, a spec file or a built-in spec's name, not {type(spec).__name__}"
                        + (" (the arguments are the other way round)" if isinstance(spec, torch.nn.Module) else ""))
    if not isinstance(spec, Spec):
        spec = load_spec(str(spec))
    b = _Binding(spec, _Model.of(model, config))
    dims = b.dimensions()
    groups = b.groups(dims)
    found = b.match_params()
    b.bind_params(found, groups, dims)
    b.check_accounted()
    untied = b.untied()
    declared = b.bind_ties(untied)
    canonical = b.bind_steps(declared)
    if b.diags:
        matched = len(spec.params) - b.unmatched
        raise BindError(b.diags, headline=_misfit_headline(spec, b.model.cls_name, matched, len(b.diags), b.model.tensors))
    after_untie = tuple(g for g in declared if not (set(g) & untied))
    problem = Problem(spaces=b.spaces, params=b.params, invariants=tuple(b.invariants), ties=after_untie,
                      outputs=spec.outputs)
    bound = BoundSpec(spec, problem, dims, canonical, tuple(declared))
    if trace and b.model.module is not None and example_inputs is not None:

        bound.graph = trace_model(b.model.module, example_inputs, bound.problem)
        bound.problem = attrs.evolve(problem, sites=bound.graph.all_sites())
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


@attrs.frozen
class _Model:
    """What binding reads of a model: its floating-point tensors, their shapes, the names
    that share storage, its config, and the module itself (None for a state dict)."""

    tensors: dict[str, torch.Tensor]
    shapes: dict[str, tuple[int, ...]]
    ties: list[tuple[str, ...]]
    cls_name: str
    config: Any
    module: torch.nn.Module | None

    @classmethod
    def of(cls, model: torch.nn.Module | Mapping[str, torch.Tensor], config: Any) -> _Model:
        tensors, ties = named_tensors(model)
        module = model if isinstance(model, torch.nn.Module) else None
        if config is None and module is not None:
            config = getattr(module, "config", None)
        return cls(tensors, {k: tuple(v.shape) for k, v in tensors.items()}, ties,
                   type(model).__name__ if module is not None else "state dict", config, module)

    def dim_context(self, dims: Mapping[str, int]) -> DimContext:
        return DimContext(dims, self.config, self.shapes, self.module)


@attrs.define
class _Binding:
    """One binding in progress: what is bound so far, and every problem found on the way
    (all of them are reported together)."""

    spec: Spec
    model: _Model
    diags: list[Diagnostic] = attrs.field(factory=list)
    hint: _HintBudget = attrs.field(factory=_HintBudget)
    #: parameter name -> the template that matched it
    owner: dict[str, ParamDecl] = attrs.field(factory=dict)
    #: how many templates matched nothing
    unmatched: int = 0
    spaces: dict[str, SpaceInstance] = attrs.field(factory=dict)
    params: dict[str, ParamBinding] = attrs.field(factory=dict)
    invariants: list[str] = attrs.field(factory=list)
    space_decls: dict[str, SpaceDecl] = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        self.space_decls = {s.name: s for s in self.spec.spaces}

    def report(self, loc: Location, message: str, hint: str | None = None) -> None:
        self.diags.append(Diagnostic(loc, message, hint))

    # -- dimensions and groups ----------------------------------------------------------------
    def dimensions(self) -> dict[str, int]:
        """The declared dimensions' values on this model."""
        exprs = {}
        for d in self.spec.dims:
            try:
                exprs[d.name] = parse_expr(d.expr)
            except ExprError as e:
                self.report(d.loc, str(e))
        dims, errors = evaluate_dims(exprs, self.model.dim_context({}))
        for d in self.spec.dims:
            if d.name in errors:
                self.report(d.loc, f"dimension {d.name} = {d.expr}: {errors[d.name]}")
        return dims

    def groups(self, dims: Mapping[str, int]) -> dict[str, Group]:
        """Each declared space's group, evaluated with the dimensions."""
        ctx = self.model.dim_context(dims)
        groups: dict[str, Group] = {}
        for s in self.spec.spaces:
            try:
                groups[s.name] = s.expr.evaluate(ctx)
            except (GroupError, ExprError) as e:
                self.report(s.loc, f"space {s.key}: group {s.group}: {e}")
        return groups

    # -- parameters ---------------------------------------------------------------------------
    def match_params(self) -> dict[ParamDecl, list[tuple[str, dict[str, int]]]]:
        """The parameters each template matches; templates that match none are reported
        (the first :data:`MAX_UNMATCHED_SHOWN` one by one, the rest counted)."""
        tensors, cls_name = self.model.tensors, self.model.cls_name
        found_by: dict[ParamDecl, list[tuple[str, dict[str, int]]]] = {}
        unmatched: list[ParamDecl] = []
        for decl in self.spec.params:
            if not decl.captures:  # a plain name: a lookup, not a scan (specs may list many)
                found = [(decl.pattern, {})] if decl.pattern in tensors else []
            else:
                found = matches(decl.pattern, tensors)
            if not found:
                unmatched.append(decl)
                if len(unmatched) <= MAX_UNMATCHED_SHOWN:
                    self.report(decl.loc, f"'{decl.pattern}' matches no parameter of {cls_name}",
                                self.hint(example_name(decl.pattern), tensors, n=3))
                continue
            found_by[decl] = found
            for name, _ in found:
                if name in self.owner:
                    self.report(decl.loc, f"'{name}' is matched by both '{self.owner[name].pattern}' and '{decl.pattern}'")
                self.owner[name] = decl
        self.unmatched = len(unmatched)
        if len(unmatched) > MAX_UNMATCHED_SHOWN:
            rest = unmatched[MAX_UNMATCHED_SHOWN:]
            shown = ", ".join(f"'{d.pattern}'" for d in rest[:3]) + (", ..." if len(rest) > 3 else "")
            self.report(rest[0].loc, f"{len(rest)} more parameter template(s) match no parameter of {cls_name}: {shown}")
        return found_by

    def bind_params(self, found_by: Mapping[ParamDecl, list[tuple[str, dict[str, int]]]],
                    groups: Mapping[str, Group], dims: Mapping[str, int]) -> None:
        """Bind every matched parameter's axes to the space instances they name."""
        for decl, found in found_by.items():
            for name, caps in found:
                if decl.invariant:
                    self.invariants.append(name)
                    continue
                pb = _ParamBinder(self, decl, name, caps, groups, dims).bind()
                if pb is not None:
                    self.params[name] = pb

    def check_accounted(self) -> None:
        """Every parameter must be bound or declared invariant."""
        unbound = [n for n in self.model.tensors if n not in self.owner]
        if unbound:
            shown = ", ".join(unbound[:8]) + (f" and {len(unbound) - 8} more" if len(unbound) > 8 else "")
            self.report(Location(self.spec.source, 0, 0, "params"),
                        f"{len(unbound)} parameter(s) of {self.model.cls_name} are neither bound nor declared invariant: {shown}",
                        "a spec must account for every parameter: bind it to a space or declare it 'invariant'")

    # -- ties and canonicalisation ------------------------------------------------------------
    def untied(self) -> set[str]:
        """The parameters the spec's steps untie."""
        names = list(self.model.tensors)
        return {n for step in self.spec.canonicalize if step.kind in STEPS for n in STEPS[step.kind].unties(step, names)}

    def bind_ties(self, untied: set[str]) -> list[tuple[str, ...]]:
        """The declared ties with concrete names. Each must be a tie of the model (unless
        untied), ask for one transform, and every tie of the model must be declared."""
        tensors, cls_name = self.model.tensors, self.model.cls_name
        tied_to: dict[str, tuple[str, ...]] = {n: g for g in self.model.ties for n in g}
        declared: list[tuple[str, ...]] = []
        for t in self.spec.ties:
            found = matches(t.params[0], tensors)
            for _, caps in found:
                names = tuple(fill(p, caps) for p in t.params)
                missing = [n for n in names if n not in tensors]
                if missing:
                    self.report(t.loc, f"tied parameter(s) {', '.join(missing)} not in {cls_name}", self.hint(missing[0], tensors))
                    continue
                declared.append(names)
                really = all(tied_to.get(n) is not None and set(names) <= set(tied_to[n]) for n in names)
                if not really and self.model.module is not None and not (set(names) & untied):
                    self.report(t.loc, f"{' and '.join(names)} are declared tied, but {cls_name} stores them separately")
                self._check_tie(names, untied, t.loc)
            if not found:
                self.report(t.loc, f"'{t.params[0]}' matches no parameter of {cls_name}", self.hint(example_name(t.params[0]), tensors))
        declared_sets = [set(d) for d in declared]
        for g in self.model.ties:
            if not any(set(g) <= d for d in declared_sets):
                self.report(Location(self.spec.source, 0, 0, "ties"), f"{cls_name} ties {' and '.join(g)} (one shared tensor), but the spec does not declare it",
                            f"add '- [{', '.join(g)}]' under ties")
        return declared

    def _check_tie(self, names: tuple[str, ...], untied: set[str], loc: Location) -> None:
        """Tied parameters must ask for the same transform, or the group would untie them."""
        if set(names) & untied:
            return
        sigs = {n: _transform_signature(self.params.get(n), self.spaces) for n in names}
        first = names[0]
        for n in names[1:]:
            if sigs[n] != sigs[first]:
                a = self.params.get(first)
                b = self.params.get(n)
                da = ", ".join(str(x) for x in a.axes) if a else "invariant"
                db = ", ".join(str(x) for x in b.axes) if b else "invariant"
                groups = sorted({str(self.spaces[f].group) for p in (a, b) if p for f in p.spaces()})
                self.report(loc, f"tied parameters {first} ({da}) and {n} ({db}) need different transforms under {', '.join(groups)}; "
                                 "the group would untie them",
                            f"use a group whose representations are orthogonal, or declare '- untie: {n}' under canonicalize")

    def bind_steps(self, ties: list[tuple[str, ...]]) -> tuple[CanonOp, ...]:
        """The spec's canonicalisation steps with concrete names, in order."""
        ctx = BindContext(self.model.tensors, self.model.shapes, ties, self.diags, self.hint)
        out: list[CanonOp] = []
        for index, step in enumerate(self.spec.canonicalize):
            impl = STEPS.get(step.kind)
            if impl is None:  # a spec built in code (loading refuses unknown kinds)
                self.report(step.loc, f"unknown step {step.kind}")
                continue
            out += impl.bind(step, index, ctx)
        return tuple(out)


@attrs.define
class _ParamBinder:
    """Binds the axes of one parameter to space instances (created on first use)."""

    binding: _Binding
    decl: ParamDecl
    name: str
    caps: dict[str, int]
    groups: Mapping[str, Group]
    dims: Mapping[str, int]

    def bind(self) -> ParamBinding | None:
        stored = self.binding.model.shapes[self.name]
        axes = self.decl.axes or ()
        view = None
        if self.decl.view is not None:
            try:
                view = AxisView(tuple(stored), self.decl.view)
            except ValueError as e:
                self.binding.report(self.decl.loc, f"{self.name} (shape {list(stored)}): {e}")
                return None
        shape = view.shape if view is not None else stored
        if len(axes) != len(shape):
            self.binding.report(self.decl.loc, f"{self.name} has {len(shape)} axes (shape {list(shape)}), the spec gives {len(axes)}")
            return None
        bindings = []
        ok = True
        for axis, expr in enumerate(axes):
            if expr is None:
                continue
            locs = self.decl.axis_locs
            loc = locs[axis] if axis < len(locs) else self.decl.loc
            segments, sizes, ok_terms = self.segments(expr, loc)
            ok = ok and ok_terms
            if not ok:  # after a failed axis, later axes are not measured
                continue
            binding = self.axis(axis, expr, segments, sizes, shape[axis], loc)
            ok = binding is not None
            if binding is not None:
                bindings.append(binding)
        return ParamBinding(self.name, tuple(shape), tuple(bindings), self.decl.loc, view) if ok else None

    def segments(self, expr: AxisExpr, loc: Location) -> tuple[list[Segment], list[int], bool]:
        """The segments of one axis (one per part of a ``cat``), their sizes, and whether
        every term was bound."""
        segments: list[Segment] = []
        sizes: list[int] = []
        start = 0
        ok = True
        for chain in expr.segments:
            factors, size, ok_chain = self.chain(chain, loc)
            ok = ok and ok_chain
            if size is None:
                continue
            sizes.append(size)
            segments.append(Segment(start, size, tuple(factors)))
            start += size
        return segments, sizes, ok

    def chain(self, chain: Chain, loc: Location) -> tuple[list[Factor], int | None, bool]:
        """The factors of a composition, the size they act on, and whether all were bound."""
        factors = []
        size = None
        ok = True
        for term in chain.terms:
            sdecl = self.binding.space_decls.get(term.space)
            group = self.groups.get(term.space)
            if sdecl is None or group is None:  # a group that did not evaluate is reported already
                ok = False
                continue
            idx = self.caps[term.index] if isinstance(term.index, str) else term.index
            inst_name = f"{term.space}[{idx}]" if sdecl.index else term.space
            if inst_name not in self.binding.spaces:
                self.binding.spaces[inst_name] = SpaceInstance(inst_name, term.space, idx if sdecl.index else None, group, sdecl.loc)
            try:
                tsize = group.rep_size(term.path)
            except GroupError as e:
                self.binding.report(loc, f"{self.name}: {e}")
                ok = False
                continue
            if size is not None and tsize != size:
                self.binding.report(loc, f"{self.name}: '{chain}' composes representations of sizes {size} and {tsize}")
                ok = False
            size = tsize
            factors.append(Factor(inst_name, term.path, term.variance))
        return factors, size, ok

    def axis(self, axis: int, expr: AxisExpr, segments: list[Segment], sizes: list[int], size: int,
             loc: Location) -> AxisBinding | None:
        """The axis binding, if the segments fill the axis (and split into its heads)."""
        total = sum(sizes)
        if total != size:
            detail = f" = {' + '.join(str(s) for s in sizes)}" if len(sizes) > 1 else ""
            used = dict.fromkeys(f.space for seg in segments for f in seg.factors)
            groups_txt = ", ".join(f"{u}: {self.binding.spaces[u].group}" for u in used)
            self.binding.report(loc, f"{self.name}: axis {axis} has size {size}, but '{expr}' ({groups_txt}) expects {total}{detail}",
                          _kv_hint(expr, size, self.groups) or "the shape contradicts the declared dimensions; check dims and groups")
            return None
        layout = None
        if expr.heads is not None:
            layout = self.head_major(expr, sizes, loc)
            if layout is None:
                return None
        return AxisBinding(axis, tuple(segments), layout)

    def head_major(self, expr: AxisExpr, sizes: list[int], loc: Location) -> HeadMajor | None:
        """The index map of ``cat(..., heads=H)``: every part splits into H equal head slices."""
        heads = expr.heads if isinstance(expr.heads, int) else self.dims.get(expr.heads)  # type: ignore[arg-type]
        if heads is None:  # an unknown or failed dimension is reported where it is declared
            self.binding.report(loc, f"{self.name}: '{expr}': the dimension '{expr.heads}' has no value")
            return None
        if heads < 1 or any(s % heads for s in sizes):
            self.binding.report(loc, f"{self.name}: '{expr}': parts of sizes {', '.join(map(str, sizes))} do not split into "
                               f"heads={expr.heads} ({heads}) equal head slices",
                          "heads= counts the blocks of the stored layout: each part holds one slice per block")
            return None
        return HeadMajor(heads, tuple(s // heads for s in sizes))


def _kv_hint(expr: AxisExpr, size: int, groups: Mapping[str, Group]) -> str | None:
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
    return (pb.view, tuple(out))


def _misfit_headline(spec: Spec, cls_name: str, matched: int, problems: int, tensors: Mapping[str, Any]) -> str:
    """The first line of a binding error: how much of the spec fits at all, and which
    built-in spec would (``--spec gpt2`` on a Llama reports ~40 problems; the fix is one)."""
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
