"""Reading one entry of a spec's ``canonicalize`` list: a mapping with one key, the step's
kind, whose value the kind validates (:mod:`symspec.canonical`: one class per kind, which
also describes itself in the JSON Schema and binds and applies the step)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..errors import suggest
from .yamlsrc import KeyPath, Source


def validate_step(src: Source, path: KeyPath, raw: Any, template_check: Callable[[str, KeyPath], None]) -> tuple[str, dict[str, Any]] | None:
    """Normalise one ``canonicalize`` entry, recording errors on ``src``."""
    # the step kinds build on this package's templates: imported when a spec is read
    from ..canonical import STEPS

    if not isinstance(raw, dict) or len(raw) != 1:
        src.error(path, "a step is a mapping with one key, its kind (e.g. '- fold_norm: {...}')")
        return None
    kind, body = next(iter(raw.items()))
    spath = (*path, kind)
    step = STEPS.get(kind)
    if step is None:
        hint = suggest(str(kind), STEPS)
        src.error(spath, f"unknown canonicalisation step '{kind}'", hint or f"known: {', '.join(STEPS)}", at_key=True)
        return None
    args = step.validate(src, spath, body, template_check)
    return None if args is None else (kind, args)
