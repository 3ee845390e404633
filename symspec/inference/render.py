"""A draft as spec YAML, formatted like the built-in specs: a header that says what was
found where, dims from the config, spaces with their evidence, ties, canonicalisation,
and every parameter accounted for (layer templates where all layers agree)."""

from __future__ import annotations

import math
import re

import yaml

from .draft import AxisBind, Draft, Factor, layer_of

_LAYER = re.compile(r"\.(\d+)\.")
#: what YAML reads as a line break
_BREAKS = ("\n", "\r", "\x85", "\u2028", "\u2029")


def _scalar(s: str, flow: bool = False) -> str:
    """``s`` as one YAML scalar on one line, written by PyYAML (plain where YAML reads it
    back as the same string, else quoted; double-quoted with escapes where a quoted
    scalar would break the line). ``flow``: an item of a flow sequence ``[a, b]``, where
    commas and brackets need quotes too. Hand-made quoting once wrote ``name: a: 'b' # c``."""
    for style in (None, '"'):
        text = yaml.safe_dump([s] if flow else s, default_flow_style=True, default_style=style, width=math.inf,
                              allow_unicode=True).removesuffix("\n").removesuffix("\n...")
        if flow:
            text = text[1:-1]
        if not any(b in text for b in _BREAKS):
            return text
    raise ValueError(f"{s!r} cannot be written on one line")  # pragma: no cover - double quotes escape every break


def _comment(s: str) -> str:
    """Text for a ``# ...`` comment: one line (an error message in a note may hold several)."""
    return re.sub("|".join(_BREAKS), " ", s)


def _q(s: str) -> str:
    """A scalar in block context (a mapping's key or value)."""
    return _scalar(s)


def _qf(s: str) -> str:
    """An item of a flow sequence ``[a, b]`` or mapping ``{a: b}``."""
    return _scalar(s, flow=True)


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
    lines = [f"# {_comment(h)}" if h else "#" for h in header]
    lines += ["symspec: 1", f"name: {_q(draft.name)}",
              f"description: {_q(f'inferred by symspec infer from the traced graph of {draft.model_class}')}",
              f"models: [{_qf(draft.model_class)}]", "", "dims:"]
    for sym, (expr, value, comment) in draft.dims.items():
        note = f"  # {_comment(comment)}" if comment else ""
        lines.append(f"  {sym}: {_q(expr)}{note}" if expr != str(value) else f"  {sym}: {value}  # from the traced shapes{'; ' + _comment(comment) if comment else ''}")
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
        lines += ["", "ties:"] + [f"  - [{_qf(a)}, {_qf(b)}]" for a, b in draft.ties]
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
        lines.append(f"  - untie: {_q(name)}")
    for kind, fold in _templated_folds(draft):
        t = template_of if kind == "t" else (lambda s: s)
        lines.append("  - fold_norm:")
        if fold.gain:
            lines.append(f"      gain: {_q(t(fold.gain))}")
        if fold.bias:
            lines.append(f"      bias: {_q(t(fold.bias))}")
        if fold.offset:
            lines.append(f"      gain_offset: {fold.offset:g}")
        if fold.bias and not fold.fold_bias:
            lines.append("      fold_bias: false        # a layer that reads it has no bias: the norm keeps its bias")
        lines.append("      into:")
        for w, a, b in fold.into:
            bias = f", bias: {_qf(t(b))}" if b and fold.fold_bias else ""
            lines.append(f"        - {{weight: {_qf(t(w))}, axis: {a}{bias}}}")
    if draft.center:
        lines.append("  - center:")
        lines.append("      writers:")
        seen = set()
        for name, axis in draft.center.items():
            key = (template_of(name), axis)
            if key in seen:
                continue
            seen.add(key)
            lines.append(f"        {_q(template_of(name))}: {axis}")
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
            lines.append(f"  {_q(tmpl)}: {values[names[0]]}" + (f"  # {_comment(note)}" if note else ""))
        else:
            for n in names:
                v = _with_view(n, param_value(draft.params[n], False, draft), draft)
                lines.append(f"  {_q(n)}: {v}" + (f"  # {_comment(note_of[n])}" if note_of[n] else ""))
    return lines


def _with_view(name: str, value: str | None, draft: Draft) -> str | None:
    """A parameter seen through a view: ``{view: [[0, 1], 2], axes: [...]}``."""
    view = draft.views.get(name)
    if view is None or value is None or value == "invariant":
        return value
    text = "[" + ", ".join(str(g[0]) if len(g) == 1 else "[" + ", ".join(map(str, g)) + "]" for g in view) + "]"
    return f"{{view: {text}, axes: {value}}}"
