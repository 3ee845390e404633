"""Parameter name templates: ``transformer.h.{i}.mlp.c_fc.weight`` names one parameter per
layer, ``{i}`` capturing the layer index.

>>> fill("h.{i}.w", {"i": 3})
'h.3.w'
>>> matches("h.{i}.w", ["h.0.w", "h.1.w", "wte"])
[('h.0.w', {'i': 0}), ('h.1.w', {'i': 1})]
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

_CAPTURE = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*)\}")
#: any braced part, valid capture or not (validation reports the invalid ones)
BRACED = re.compile(r"\{([^{}]*)\}")


def captures_of(template: str) -> tuple[str, ...]:
    """The names a template captures, in order."""
    return tuple(m.group(1) for m in BRACED.finditer(template))


def template_regex(template: str) -> re.Pattern[str]:
    """The regular expression a template stands for: each capture matches a decimal index."""
    out = []
    pos = 0
    for m in _CAPTURE.finditer(template):
        out.append(re.escape(template[pos : m.start()]))
        out.append(f"(?P<{m.group(1)}>\\d+)")
        pos = m.end()
    out.append(re.escape(template[pos:]))
    return re.compile("".join(out))


def fill(template: str, captures: Mapping[str, Any]) -> str:
    """The concrete name for these capture values."""
    return _CAPTURE.sub(lambda m: str(captures[m.group(1)]), template)


def example_name(template: str) -> str:
    """The template filled with 0 for every capture: what a "did you mean" compares."""
    return fill(template, {c: 0 for c in captures_of(template)})


def matches(template: str, names: Iterable[str]) -> list[tuple[str, dict[str, int]]]:
    """Every name the template matches, with its capture values."""
    rx = template_regex(template)
    return [(n, {k: int(v) for k, v in m.groupdict().items()}) for n in names if (m := rx.fullmatch(n))]
