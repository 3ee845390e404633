"""Declarations of the canonicalisation steps a spec may list.

Each step kind declares its arguments once; the same declaration validates spec files
(with located errors) and generates the JSON Schema. The implementations live in
:mod:`symspec.transforms.canonical`, keyed by the same names.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import attrs

from .yamlsrc import KeyPath, Source


@attrs.frozen
class Arg:
    name: str
    type: str  # template | int | number | bool | string | readers | writers
    required: bool = False
    default: Any = None
    doc: str = ""


@attrs.frozen
class StepSchema:
    name: str
    doc: str
    args: tuple[Arg, ...]
    #: the argument a scalar shorthand (``- untie: lm_head.weight``) fills
    shorthand: str | None = None

    def arg(self, name: str) -> Arg | None:
        return next((a for a in self.args if a.name == name), None)


READER = (
    Arg("weight", "template", True, doc="a weight that reads the normalised vector"),
    Arg("axis", "int", True, doc="the weight's axis that reads it (its input axis)"),
    Arg("bias", "template", False, doc="the reader's bias, which absorbs the norm's bias"),
)

STEPS: dict[str, StepSchema] = {
    s.name: s
    for s in (
        StepSchema(
            "untie",
            "Give a tied parameter its own storage (an explicit, declared untie; the model "
            "keeps its class and its function). Needed before folding a norm into a tied "
            "unembedding.",
            (Arg("param", "template", True, doc="the parameter to untie from its twin"),),
            shorthand="param",
        ),
        StepSchema(
            "fold_norm",
            "Fold a LayerNorm/RMSNorm gain (and bias) into the weights that read the norm's "
            "output; the norm's gain becomes 1 (and its bias 0). A norm that scales by "
            "(gain_offset + weight), such as Gemma's RMSNorm (1 + weight), folds that factor "
            "and its weight becomes 1 - gain_offset (0 for Gemma).",
            (
                Arg("gain", "template", True, doc="the norm's weight"),
                Arg("gain_offset", "number", False,
                    doc="the norm multiplies by (gain_offset + weight); default 0 (1 for Gemma's RMSNorm, x * (1 + w))"),
                Arg("bias", "template", False, doc="the norm's bias, if it has one"),
                Arg("fold_bias", "bool", False, True, doc="fold the bias into the readers' biases (else keep it)"),
                Arg("into", "readers", True, doc="the readers: weight, input axis, bias"),
            ),
        ),
        StepSchema(
            "center",
            "Mean-centre the writers of a pre-LN residual stream along their residual axis. "
            "Pre-LN readers subtract the mean anyway, so the all-ones component carries no "
            "function; removing it makes independently trained models comparable there. "
            "The residual then lives in the zero-mean subspace.",
            (Arg("writers", "writers", True, doc="parameter -> its residual axis"),),
        ),
    )
}


def validate_step(src: Source, path: KeyPath, raw: Any, template_check: Callable[[str, KeyPath], None]) -> tuple[str, dict[str, Any]] | None:
    """Normalise one ``canonicalize`` entry, recording errors on ``src``."""
    from ..errors import suggest

    if not isinstance(raw, dict) or len(raw) != 1:
        src.error(path, "a step is a mapping with one key, its kind (e.g. '- fold_norm: {...}')")
        return None
    kind, body = next(iter(raw.items()))
    spath = (*path, kind)
    schema = STEPS.get(kind)
    if schema is None:
        hint = suggest(str(kind), STEPS)
        src.error(spath, f"unknown canonicalisation step '{kind}'", hint or f"known: {', '.join(STEPS)}", at_key=True)
        return None
    if not isinstance(body, dict):
        if schema.shorthand is None:
            src.error(spath, f"{kind} takes a mapping of arguments: {', '.join(a.name for a in schema.args)}")
            return None
        body = {schema.shorthand: body}
    out: dict[str, Any] = {}
    for key in body:
        if schema.arg(str(key)) is None:
            src.error((*spath, key), f"{kind} has no argument '{key}'", suggest(str(key), [a.name for a in schema.args]), at_key=True)
    for a in schema.args:
        if a.name not in body:
            if a.required:
                src.error(spath, f"{kind} needs '{a.name}' ({a.doc})")
            elif a.default is not None:
                out[a.name] = a.default
            continue
        value = _arg(src, (*spath, a.name), a, body[a.name], template_check)
        if value is not None:
            out[a.name] = value
    return kind, out


def _arg(src: Source, path: KeyPath, a: Arg, value: Any, template_check: Callable[[str, KeyPath], None]) -> Any:
    if a.type == "template":
        if not isinstance(value, str):
            src.error(path, f"expected a parameter name, got {value!r}")
            return None
        template_check(value, path)
        return value
    if a.type == "int":
        if isinstance(value, bool) or not isinstance(value, int):
            src.error(path, f"expected an integer, got {value!r}")
            return None
        return value
    if a.type == "number":
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            src.error(path, f"expected a number, got {value!r}")
            return None
        return value
    if a.type == "bool":
        if not isinstance(value, bool):
            src.error(path, f"expected true or false, got {value!r}")
            return None
        return value
    if a.type == "string":
        return str(value)
    if a.type == "readers":
        if not isinstance(value, list) or not value:
            src.error(path, "expected a list of readers, each {weight: ..., axis: ..., bias: ...}")
            return None
        readers = []
        for i, item in enumerate(value):
            ipath = (*path, i)
            if not isinstance(item, dict):
                src.error(ipath, "a reader is a mapping {weight: NAME, axis: N, bias: NAME}")
                continue
            r: dict[str, Any] = {}
            for key in item:
                if key not in ("weight", "axis", "bias"):
                    from ..errors import suggest

                    src.error((*ipath, key), f"a reader has no field '{key}'", suggest(str(key), ["weight", "axis", "bias"]), at_key=True)
            for sub in READER:
                if sub.name not in item:
                    if sub.required:
                        src.error(ipath, f"a reader needs '{sub.name}' ({sub.doc})")
                    continue
                v = _arg(src, (*ipath, sub.name), sub, item[sub.name], template_check)
                if v is not None:
                    r[sub.name] = v
            readers.append(r)
        return readers
    if a.type == "writers":
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
    raise AssertionError(a.type)  # pragma: no cover - schema is internal


def json_schema_for(schema: StepSchema) -> dict[str, Any]:
    props: dict[str, Any] = {}
    for a in schema.args:
        props[a.name] = _json_type(a)
    body: dict[str, Any] = {
        "type": "object",
        "description": schema.doc,
        "properties": props,
        "required": [a.name for a in schema.args if a.required],
        "additionalProperties": False,
    }
    if schema.shorthand:
        body = {"oneOf": [{"type": "string", "description": f"shorthand for {{{schema.shorthand}: ...}}"}, body]}
    return {
        "type": "object",
        "properties": {schema.name: body},
        "required": [schema.name],
        "additionalProperties": False,
    }


def _json_type(a: Arg) -> dict[str, Any]:
    if a.type in ("template", "string"):
        return {"type": "string", "description": a.doc}
    if a.type == "int":
        return {"type": "integer", "description": a.doc}
    if a.type == "number":
        return {"type": "number", "description": a.doc}
    if a.type == "bool":
        return {"type": "boolean", "description": a.doc}
    if a.type == "readers":
        return {
            "type": "array",
            "description": a.doc,
            "minItems": 1,
            "items": {
                "type": "object",
                "properties": {r.name: _json_type(r) for r in READER},
                "required": [r.name for r in READER if r.required],
                "additionalProperties": False,
            },
        }
    if a.type == "writers":
        return {"type": "object", "description": a.doc, "minProperties": 1, "additionalProperties": {"type": "integer"}}
    raise AssertionError(a.type)  # pragma: no cover
