"""The arguments a canonicalisation step kind declares (:mod:`symspec.spec.steps`): each kind
of argument reads its YAML value (recording located errors) and describes itself in the JSON
Schema."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import attrs

from ..errors import suggest
from .yamlsrc import KeyPath, Source

#: checks a parameter name template where it appears (see :func:`symspec.spec.load.check_template`)
TemplateCheck = Callable[[str, KeyPath], None]


@attrs.frozen
class Arg:
    """One argument of a step: its name, whether it is required, its default and doc."""

    name: str
    required: bool = False
    default: Any = None
    doc: str = ""

    def read(self, src: Source, path: KeyPath, value: Any, template_check: TemplateCheck) -> Any:
        """The validated value, or None after recording an error on ``src``."""
        raise NotImplementedError

    def json(self) -> dict[str, Any]:
        raise NotImplementedError


@attrs.frozen
class TemplateArg(Arg):
    """A parameter name template (``transformer.h.{i}.ln_1.weight``)."""

    def read(self, src: Source, path: KeyPath, value: Any, template_check: TemplateCheck) -> Any:
        if not isinstance(value, str):
            src.error(path, f"expected a parameter name, got {value!r}")
            return None
        template_check(value, path)
        return value

    def json(self) -> dict[str, Any]:
        return {"type": "string", "description": self.doc}


@attrs.frozen
class IntArg(Arg):
    """An integer (an axis)."""

    def read(self, src: Source, path: KeyPath, value: Any, template_check: TemplateCheck) -> Any:
        if isinstance(value, bool) or not isinstance(value, int):
            src.error(path, f"expected an integer, got {value!r}")
            return None
        return value

    def json(self) -> dict[str, Any]:
        return {"type": "integer", "description": self.doc}


@attrs.frozen
class NumberArg(Arg):
    """A finite number."""

    def read(self, src: Source, path: KeyPath, value: Any, template_check: TemplateCheck) -> Any:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            src.error(path, f"expected a number, got {value!r}")
            return None
        return value

    def json(self) -> dict[str, Any]:
        return {"type": "number", "description": self.doc}


@attrs.frozen
class BoolArg(Arg):
    """true or false."""

    def read(self, src: Source, path: KeyPath, value: Any, template_check: TemplateCheck) -> Any:
        if not isinstance(value, bool):
            src.error(path, f"expected true or false, got {value!r}")
            return None
        return value

    def json(self) -> dict[str, Any]:
        return {"type": "boolean", "description": self.doc}


#: the fields of one reader of a norm
READER = (
    TemplateArg("weight", True, doc="a weight that reads the normalised vector"),
    IntArg("axis", True, doc="the weight's axis that reads it (its input axis)"),
    TemplateArg("bias", False, doc="the reader's bias, which absorbs the norm's bias"),
)


@attrs.frozen
class ReadersArg(Arg):
    """A non-empty list of readers ``{weight: NAME, axis: N, bias: NAME}`` (:data:`READER`)."""

    def read(self, src: Source, path: KeyPath, value: Any, template_check: TemplateCheck) -> Any:
        if not isinstance(value, list) or not value:
            src.error(path, "expected a list of readers, each {weight: ..., axis: ..., bias: ...}")
            return None
        readers = []
        for i, item in enumerate(value):
            ipath = (*path, i)
            if not isinstance(item, dict):
                src.error(ipath, "a reader is a mapping {weight: NAME, axis: N, bias: NAME}")
                continue
            for key in item:
                if key not in [f.name for f in READER]:
                    src.error((*ipath, key), f"a reader has no field '{key}'", suggest(str(key), [f.name for f in READER]), at_key=True)
            r: dict[str, Any] = {}
            for sub in READER:
                if sub.name not in item:
                    if sub.required:
                        src.error(ipath, f"a reader needs '{sub.name}' ({sub.doc})")
                    continue
                v = sub.read(src, (*ipath, sub.name), item[sub.name], template_check)
                if v is not None:
                    r[sub.name] = v
            readers.append(r)
        return readers

    def json(self) -> dict[str, Any]:
        return {
            "type": "array",
            "description": self.doc,
            "minItems": 1,
            "items": {
                "type": "object",
                "properties": {r.name: r.json() for r in READER},
                "required": [r.name for r in READER if r.required],
                "additionalProperties": False,
            },
        }


@attrs.frozen
class WritersArg(Arg):
    """A non-empty mapping: parameter name template -> its residual axis."""

    def read(self, src: Source, path: KeyPath, value: Any, template_check: TemplateCheck) -> Any:
        if not isinstance(value, dict) or not value:
            src.error(path, "expected a mapping: parameter name -> its residual axis")
            return None
        writers = {}
        for name, axis in value.items():
            wpath = (*path, name)
            template_check(str(name), wpath)
            if isinstance(axis, bool) or not isinstance(axis, int):
                src.error(wpath, f"expected the residual axis (an integer), got {axis!r}")
                continue
            writers[str(name)] = axis
        return writers

    def json(self) -> dict[str, Any]:
        return {"type": "object", "description": self.doc, "minProperties": 1, "additionalProperties": {"type": "integer"}}
