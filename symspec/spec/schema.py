"""The JSON Schema of the spec format (``symspec schema``), generated from the same
declarations the validator uses, so that editors can validate spec files."""

from __future__ import annotations

from typing import Any

from ..groups import REGISTRY
from .load import FORMAT_VERSION
from .steps import STEP_KINDS

AXIS_DOC = (
    "An axis expression: 'resid' (covariant), 'resid*' (contravariant: an input axis or the dual "
    "side of a pairing), 'abs(resid)', 'ff[i]' (per layer), 'attn[i].qk' (a part of a head group), "
    "'attn[i].qk.kv' (its key/value view), 'a @ b' (composition, b acts first), "
    "'cat(a, b, c)' (a concatenated axis), 'cat(a, b, c, heads=H)' (the same parts stored per head, "
    "[h0: a b c][h1: a b c]...), or '_' (untouched)."
)


def json_schema() -> dict[str, Any]:
    group_doc = "A group: " + "; ".join(f"{k}: {v}" for k, v in sorted((k, (c.__doc__ or '').strip().splitlines()[0]) for k, c in REGISTRY.items()))
    axis = {"anyOf": [{"type": "string", "description": AXIS_DOC}, {"type": "null"}]}
    axes = {"type": "array", "items": axis, "minItems": 1}
    param = {
        "anyOf": [
            {"const": "invariant", "description": "untouched by every group"},
            axes,
            {
                "type": "object",
                "properties": {"axes": axes, "invariant": {"type": "boolean"}, "doc": {"type": "string"},
                               "view": {"type": "array", "minItems": 1,
                                        "description": "per bound axis, a stored axis or a list of stored axes merged "
                                                       "into it, outermost first: [[0, 1], 2] sees [E, f, d] as [E*f, d]",
                                        "items": {"anyOf": [{"type": "integer", "minimum": 0},
                                                            {"type": "array", "minItems": 1,
                                                             "items": {"type": "integer", "minimum": 0}}]}}},
                "additionalProperties": False,
            },
        ]
    }
    group = {"type": "string", "description": group_doc}
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$id": "https://symspec.dev/schema/spec-v1.json",
        "title": "symspec symmetry spec",
        "description": "Declares the weight-space symmetry groups of a model's parameters.",
        "type": "object",
        "required": ["symspec", "name", "spaces", "params"],
        "additionalProperties": False,
        "properties": {
            "symspec": {"const": FORMAT_VERSION, "description": "the format version"},
            "name": {"type": "string"},
            "description": {"type": "string"},
            "models": {"type": "array", "items": {"type": "string"}, "description": "model class names this spec fits"},
            "dims": {
                "type": "object",
                "description": "dimension name -> expression (config.<attr>, shape(\"param\", axis), + - * / //, first(a, b))",
                "propertyNames": {"pattern": "^[A-Za-z_][A-Za-z0-9_]*$"},
                "additionalProperties": {"type": ["string", "integer"]},
            },
            "spaces": {
                "type": "object",
                "description": "space name (or name[i], per layer) -> group",
                "propertyNames": {"pattern": r"^[A-Za-z_][A-Za-z0-9_]*(\[[A-Za-z_][A-Za-z0-9_]*\])?$"},
                "additionalProperties": {
                    "anyOf": [
                        group,
                        {
                            "type": "object",
                            "required": ["group"],
                            "properties": {"group": group, "doc": {"type": "string"}},
                            "additionalProperties": False,
                        },
                    ]
                },
            },
            "params": {
                "type": "object",
                "description": "parameter name template (with {i} captures) -> axes or 'invariant'",
                "additionalProperties": param,
            },
            "outputs": {
                "type": "array",
                "description": "the model outputs the symmetries preserve (keys of its output, e.g. logits); "
                               "default: every floating-point output",
                "items": {"type": "string", "minLength": 1},
                "uniqueItems": True,
            },
            "ties": {
                "type": "array",
                "items": {"type": "array", "items": {"type": "string"}, "minItems": 2},
            },
            "canonicalize": {
                "type": "array",
                "items": {"oneOf": [s.json_schema() for s in STEP_KINDS.values()]},
            },
        },
    }
