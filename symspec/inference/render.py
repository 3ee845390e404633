"""A draft as spec YAML, formatted like the built-in specs: a header that says what was
found where, dims from the config, spaces with their evidence, ties, canonicalisation,
and every parameter accounted for (layer templates where all layers agree)."""

from __future__ import annotations

import json
import re

from .draft import AxisBind, Draft, Factor, layer_of

_LAYER = re.compile(r"\.(\d+)\.")


def _quote(s: str) -> str:
    """Single-quoted YAML (a double quote inside needs no escape), else JSON-style."""
    return f"'{s}'" if "'" not in s else json.dumps(s)


def _q(s: str) -> str:
    """A block scalar, quoted only where YAML would read it otherwise."""
    if not s or s != s.strip() or s[0] in "[]{}&*!|>'\"%@`,?-:#" or re.search(r": |\s#", s):
        return _quote(s)
    return s


def _qf(s: str) -> str:
    """An item of a flow sequence ``[a, b]``: quoted when it holds a flow indicator."""
    if re.search(r"[,\[\]{}#:]", s) or s[0] in "&*!|>'\"%@`?-":
        return _quote(s)
    return s


def factor_text(f: Factor, templated: bool, drafts: Draft) -> str | None:
    sp = drafts.spaces.get(f.space)
    if sp is None or not sp.alive:
        return None
    idx = "" if f.index is None else "[i]" if templated else f"[{f.index}]"
    path = f".{f.path}" if f.path else ""
    text = f"{f.space}{idx}{path}{'*' if f.dual else ''}"
    return f"abs({text})" if f.absval else text


def axis_text(b: AxisBind, templated: bool, draft: Draft) -> str:
    chains = []
    for chain in b.chains:
        parts = [t for t in (factor_text(f, templated, draft) for f in chain) if t is not None]
        chains.append(" @ ".join(parts) if parts else "_")
    if not b.cat:
        return chains[0]
    if all(c == "_" for c in chains):
        return "_"
    if any(c == "_" for c in chains):
        return "_"
    heads = f", heads={b.heads}" if b.heads else ""
    return f"cat({', '.join(chains)}{heads})"


def param_value(axes: list[AxisBind] | str, templated: bool, draft: Draft) -> str | None:
    if isinstance(axes, str):
        return axes
    texts = [axis_text(b, templated, draft) for b in axes]
    if all(t == "_" for t in texts):
        return "invariant"
    return "[" + ", ".join(_qf(t) for t in texts) + "]"


def template_of(name: str) -> str:
    return _LAYER.sub(".{i}.", name, count=1)


def render(draft: Draft, header: list[str]) -> str:
    lines = [f"# {h}" if h else "#" for h in header]
    lines += ["symspec: 1", f"name: {draft.name}",
              f"description: inferred by symspec infer from the traced graph of {draft.model_class}",
              f"models: [{draft.model_class}]", "", "dims:"]
    for sym, (expr, value, comment) in draft.dims.items():
        note = f"  # {comment}" if comment else ""
        lines.append(f"  {sym}: {_q(expr)}{note}" if expr != str(value) else f"  {sym}: {value}  # from the traced shapes{'; ' + comment if comment else ''}")
    alive = sorted((sp for sp in draft.spaces.values() if sp.alive), key=lambda sp: (sp.base not in ("resid", "sgn"), sp.base == "sgn"))
    lines += ["", "spaces:"]
    if not alive:
        lines[-1] = "spaces: {}"
    for sp in alive:
        lines.append(f"  {sp.key()}:")
        lines.append(f"    group: {_q(sp.group_text())}")
        doc = "; ".join(sp.evidence) if sp.evidence else sp.doc
        for h in sp.history:
            doc += f"; {h[0]} failed the check ({h[2]}), shrunk to {h[1]}"
        lines.append(f"    doc: {_q(doc)}")
    if draft.ties:
        lines += ["", "ties:"] + [f"  - [{a}, {b}]" for a, b in draft.ties]
    steps = _steps(draft)
    if steps:
        lines += ["", "canonicalize:", *steps]
    lines += ["", "params:", *_params(draft)]
    return "\n".join(lines) + "\n"


def _templated_folds(draft: Draft) -> list[tuple[str, object]]:
    """Folds grouped by their template (one step for every layer's copy of a norm)."""
    groups: dict[str, list] = {}
    for fold in draft.folds:
        key = template_of(fold.gain or fold.bias or "")
        groups.setdefault(key, []).append(fold)
    out = []
    for key, folds in groups.items():
        first = folds[0]
        same = all(
            [template_of(w) + f"|{a}|" + (template_of(b) if b else "") for w, a, b in f.into]
            == [template_of(w) + f"|{a}|" + (template_of(b) if b else "") for w, a, b in first.into]
            and f.fold_bias == first.fold_bias and f.offset == first.offset for f in folds)
        n_layers = len({layer_of(f.gain or f.bias or "") for f in folds})
        if same and (n_layers == len(folds)) and ("{i}" in key):
            out.append(("t", first))
        else:
            out += [("l", f) for f in folds]
    return out


def _steps(draft: Draft) -> list[str]:
    lines: list[str] = []
    for name in draft.untie:
        lines.append(f"  - untie: {name}")
    for kind, fold in _templated_folds(draft):
        t = template_of if kind == "t" else (lambda s: s)
        lines.append("  - fold_norm:")
        if fold.gain:
            lines.append(f"      gain: {t(fold.gain)}")
        if fold.bias:
            lines.append(f"      bias: {t(fold.bias)}")
        if fold.offset:
            lines.append(f"      gain_offset: {fold.offset:g}")
        if fold.bias and not fold.fold_bias:
            lines.append("      fold_bias: false        # a layer that reads it has no bias: the norm keeps its bias")
        lines.append("      into:")
        for w, a, b in fold.into:
            bias = f", bias: {json.dumps(t(b))}" if b and fold.fold_bias else ""
            lines.append(f"        - {{weight: {json.dumps(t(w))}, axis: {a}{bias}}}")
    if draft.center:
        lines.append("  - center:")
        lines.append("      writers:")
        seen = set()
        for name, axis in draft.center.items():
            key = (template_of(name), axis)
            if key in seen:
                continue
            seen.add(key)
            lines.append(f"        {template_of(name)}: {axis}")
    return lines


def _params(draft: Draft) -> list[str]:
    """One line per template when every layer binds the same way, else per parameter."""
    by_template: dict[str, list[str]] = {}
    for name in draft.params:
        by_template.setdefault(template_of(name), []).append(name)
    lines = []
    for tmpl, names in by_template.items():
        values = {n: _with_view(n, param_value(draft.params[n], True, draft), draft) for n in names}
        uniform = "{i}" in tmpl and len(set(values.values())) == 1 and len(names) > 0 \
            and all(layer_of(n) is not None for n in names)
        note_of = {n: draft.param_notes.get(n, "") for n in names}
        if uniform:
            note = note_of[names[0]] if len(set(note_of.values())) == 1 else ""
            lines.append(f"  {tmpl}: {values[names[0]]}" + (f"  # {note}" if note else ""))
        else:
            for n in names:
                v = _with_view(n, param_value(draft.params[n], False, draft), draft)
                lines.append(f"  {n}: {v}" + (f"  # {note_of[n]}" if note_of[n] else ""))
    return lines


def _with_view(name: str, value: str | None, draft: Draft) -> str | None:
    """A parameter seen through a view: ``{view: [[0, 1], 2], axes: [...]}``."""
    view = draft.views.get(name)
    if view is None or value is None or value == "invariant":
        return value
    text = "[" + ", ".join(str(g[0]) if len(g) == 1 else "[" + ", ".join(map(str, g)) + "]" for g in view) + "]"
    return f"{{view: {text}, axes: {value}}}"
