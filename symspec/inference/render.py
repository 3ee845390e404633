"""A draft as the spec language's own objects (:class:`~symspec.spec.model.Spec`), written
by the spec writer (:func:`~symspec.spec.write.dump_spec`) like the built-in specs: a header
that says what was found where, dims from the config, spaces with their evidence, ties,
canonicalisation, and every parameter accounted for (layer templates where all layers
agree). A space shrunk to the identity disappears from every axis that named it."""

from __future__ import annotations

import attrs

from ..spec.model import (
    AxisExpr,
    Chain,
    DimDecl,
    ParamDecl,
    Spec,
    StepDecl,
    Term,
    TieDecl,
)
from ..spec.write import NoteKey, dump_spec
from .draft import Draft, Fold, layer_of, template_of

#: the comment on a norm whose bias stays
_KEEPS_BIAS = "a layer that reads it has no bias: the norm keeps its bias"


def render(draft: Draft, header: list[str]) -> str:
    """The draft as spec YAML, with ``header`` as its leading comment."""
    spec, notes = to_spec(draft)
    return dump_spec(spec, header=header, notes=notes)


def to_spec(draft: Draft) -> tuple[Spec, dict[NoteKey, str]]:
    """The spec the draft declares now (spaces shrunk to the identity left out), and the
    comments that go with it (where a dimension or an invariant parameter comes from)."""
    notes: dict[NoteKey, str] = {}
    dims = []
    for sym, (expr, value, why) in draft.dims.items():
        if expr == str(value):
            why = "from the traced shapes" + (f"; {why}" if why else "")
        dims.append(DimDecl(sym, expr))
        if why:
            notes["dims", sym] = why
    alive = sorted((sp for sp in draft.spaces.values() if sp.alive), key=lambda sp: (sp.base not in ("resid", "sgn"), sp.base == "sgn"))
    spaces = tuple(sp.decl() for sp in alive)
    steps = _steps(draft, notes)
    params = _params(draft, notes)
    spec = Spec(draft.name, 1, f"inferred by symspec infer from the traced graph of {draft.model_class}", (draft.model_class,),
                tuple(dims), spaces, params, tuple(TieDecl(tuple(t)) for t in draft.ties), steps,
                outputs=tuple(draft.outputs))
    return spec, notes


def _axis(expr: AxisExpr, templated: bool, draft: Draft) -> AxisExpr | None:
    """``expr`` with the terms of dead spaces left out and layers as ``[i]`` where
    ``templated``; None where nothing acts any more (in a concatenation: on any part)."""
    chains = []
    for chain in expr.segments:
        terms = tuple(_term(t, templated) for t in chain.terms
                      if (sp := draft.spaces.get(t.space)) is not None and sp.alive)
        if not terms:
            return None
        chains.append(Chain(terms))
    return attrs.evolve(expr, segments=tuple(chains), heads=expr.heads if expr.cat else None)


def _term(t: Term, templated: bool) -> Term:
    return t if t.index is None or not templated else attrs.evolve(t, index="i")


def _param(pattern: str, value: list[AxisExpr] | str, templated: bool, draft: Draft) -> ParamDecl:
    if isinstance(value, str):  # "invariant"
        return ParamDecl(pattern, None, True)
    axes = tuple(_axis(a, templated, draft) for a in value)
    if all(a is None for a in axes):
        return ParamDecl(pattern, None, True)
    return ParamDecl(pattern, axes)


def _params(draft: Draft, notes: dict[NoteKey, str]) -> tuple[ParamDecl, ...]:
    """One entry per template when every layer binds the same way, else per parameter."""
    by_template: dict[str, list[str]] = {}
    for name in draft.params:
        by_template.setdefault(template_of(name), []).append(name)
    out = []
    for tmpl, names in by_template.items():
        decls = {n: _viewed(_param(tmpl, draft.params[n], True, draft), n, draft) for n in names}
        uniform = "{i}" in tmpl and len(set(decls.values())) == 1 and all(layer_of(n) is not None for n in names)
        note_of = {n: draft.param_notes.get(n, "") for n in names}
        if uniform:
            out.append(decls[names[0]])
            note = note_of[names[0]] if len(set(note_of.values())) == 1 else ""
            if note:
                notes["params", tmpl] = note
            continue
        for n in names:
            out.append(_viewed(_param(n, draft.params[n], False, draft), n, draft))
            if note_of[n]:
                notes["params", n] = note_of[n]
    return tuple(out)


def _viewed(decl: ParamDecl, name: str, draft: Draft) -> ParamDecl:
    """A parameter seen through a view (``{view: [[0, 1], 2], axes: [...]}``)."""
    view = draft.views.get(name)
    return decl if view is None or decl.invariant else attrs.evolve(decl, view=view)


def _templated_folds(draft: Draft) -> list[tuple[bool, Fold]]:
    """Folds grouped by their template (one step for every layer's copy of a norm);
    True where the fold is written as a template."""
    groups: dict[str, list[Fold]] = {}
    for fold in draft.folds:
        groups.setdefault(template_of(fold.gain or fold.bias or ""), []).append(fold)

    def shape(f: Fold) -> list[str]:
        return [template_of(w) + f"|{a}|" + (template_of(b) if b else "") for w, a, b in f.into]

    out: list[tuple[bool, Fold]] = []
    for key, folds in groups.items():
        first = folds[0]
        same = all(shape(f) == shape(first) and f.fold_bias == first.fold_bias and f.offset == first.offset for f in folds)
        n_layers = len({layer_of(f.gain or f.bias or "") for f in folds})
        # a template matches every layer's norm: only where every layer's norm is folded so,
        # and into readers of its own layer (a post-LN model's last norm, read by the head
        # alone, written as a template, would fold every layer's norm into the head)
        every = len(folds) == sum(1 for name in draft.params if template_of(name) == key)
        own = all("{i}" in template_of(w) for w, _, _ in first.into)
        if same and n_layers == len(folds) and "{i}" in key and every and own:
            out.append((True, first))
        else:
            out += [(False, f) for f in folds]
    return out


def _fold_step(fold: Fold, templated: bool) -> StepDecl:
    t = template_of if templated else (lambda s: s)
    args: dict[str, object] = {"gain": t(fold.gain)} if fold.gain else {}
    if fold.offset:
        args["gain_offset"] = fold.offset
    if fold.bias:
        args["bias"] = t(fold.bias)
    args["fold_bias"] = not (fold.bias and not fold.fold_bias)  # written only where a bias stays
    args["into"] = [{"weight": t(w), "axis": a, **({"bias": t(b)} if b and fold.fold_bias else {})} for w, a, b in fold.into]
    return StepDecl.make("fold_norm", args)


def _steps(draft: Draft, notes: dict[NoteKey, str]) -> tuple[StepDecl, ...]:
    steps = [StepDecl.make("untie", {"param": name}) for name in draft.untie]
    for templated, fold in _templated_folds(draft):
        if fold.bias and not fold.fold_bias:
            notes["canonicalize", len(steps), "fold_bias"] = _KEEPS_BIAS
        steps.append(_fold_step(fold, templated))
    if draft.center:
        writers: dict[str, int] = {}
        for name, ax in draft.center.items():
            writers.setdefault(template_of(name), ax)
        steps.append(StepDecl.make("center", {"writers": writers}))
    return tuple(steps)
