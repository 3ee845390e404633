"""The report of a universe run (``report.json``, ``symspec universe --json``) and its
JSON Schema (docs/universe.md). The analysis part is the analyzers' own: this module
takes its schema as an argument, so that the core never imports the analyzers.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .._version import __version__
from ..io_util import json_safe
from .result import UniverseResult

SCHEMA_ID = "symspec.universe/1"


def build_report(result: UniverseResult, analysis: Any = None, *, seconds: float | None = None) -> dict[str, Any]:
    """The JSON report (schema :data:`SCHEMA_ID`, :func:`report_schema`; docs/universe.md):
    :meth:`UniverseResult.summary` plus ``analysis``: anything with a ``to_dict()`` (the
    CLI gives a :class:`~symspec.analyzers.simplex.MergeAnalysis`), or None."""
    doc: dict[str, Any] = {"schema": SCHEMA_ID, "symspec_version": __version__}
    doc.update(result.summary())
    doc["analysis"] = analysis.to_dict() if analysis is not None else None
    doc["seconds"] = result.timings.get("total", 0.0) if seconds is None else seconds
    return json_safe(doc)


def report_schema(analysis: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """JSON Schema of :func:`build_report`'s document (with ``outputs`` as
    :func:`~symspec.universe.save_outputs` writes it). ``analysis``: the schema of the
    ``analysis`` part (the analyzers' ``symspec.analyzers.simplex.ANALYSIS_SCHEMA`` for
    the CLI's); None: any object."""
    analysis_schema = dict(analysis) if analysis is not None else {"type": "object"}

    num = {"oneOf": [{"type": "number"}, {"enum": ["inf", "-inf", "nan"]}]}
    nums = {"type": "array", "items": num}
    model = {"type": "object", "required": ["name", "before", "after", "match_rounds", "seconds"],
             "properties": {"name": {"type": "string"}, "before": num, "after": num,
                            "match_rounds": {"type": ["integer", "null"]}, "seconds": {"type": ["number", "null"]}}}
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": "symspec universe report",
        "type": "object",
        "required": ["schema", "symspec_version", "spec", "groups", "method", "start", "models", "rounds", "converged", "objective",
                     "relative_objective", "per_round", "executor", "jobs", "dtype", "resumed_tasks", "timings",
                     "analysis", "seconds"],
        "properties": {
            "schema": {"const": SCHEMA_ID},
            "symspec_version": {"type": "string"},
            "spec": {"type": "string"},
            "groups": {"type": "string"},
            "method": {"type": "string"},
            "start": {"type": "string"},
            "models": {"type": "array", "minItems": 2, "items": {
                "type": "object", "required": ["index", "name", "key", "format", "distance_before", "distance_after"],
                "properties": {"index": {"type": "integer", "minimum": 0}, "name": {"type": "string"},
                               "key": {"type": "string"}, "format": {"type": "string"},
                               "distance_before": num, "distance_after": num}}},
            "rounds": {"type": "integer", "minimum": 1},
            "converged": {"type": "boolean"},
            "objective": {**nums, "minItems": 2},
            "relative_objective": nums,
            "converged_on": {"enum": ["weights", "method"]},
            "method_objective": nums,
            "per_round": {"type": "array", "items": {
                "type": "object",
                "required": ["round", "objective", "target_objective", "universe_change", "floor", "seconds", "models"],
                "properties": {"round": {"type": "integer", "minimum": 1}, "objective": num, "target_objective": num,
                               "universe_change": num, "floor": num, "seconds": {"type": "number", "minimum": 0},
                               "method_objective": num, "method_objective_start": num,
                               "models": {"type": "array", "items": model}}}},
            "executor": {"enum": ["inline", "processes", "ray"]},
            "jobs": {"type": "integer", "minimum": 1},
            "dtype": {"type": "string"},
            "resumed_tasks": {"type": "integer", "minimum": 0},
            "timings": {"type": "object", "additionalProperties": {"type": "number"}},
            "analysis": {"oneOf": [analysis_schema, {"type": "null"}]},
            "seconds": {"type": "number", "minimum": 0},
            "refinement": {"type": "object", "description": "the learned refinement (--method learned)",
                           "required": ["alpha", "steps", "history", "best_step", "best_val_merged_loss",
                                        "val_merged_loss", "checks", "validation"],
                           "properties": {"alpha": {"type": "number"}, "steps": {"type": "integer", "minimum": 0},
                                          "history": nums, "best_step": {"type": "integer", "minimum": 0},
                                          "best_val_merged_loss": num, "validation": {"type": "string"},
                                          "val_merged_loss": {"type": "array"},
                                          "checks": {"type": "object", "additionalProperties": {
                                              "type": "object", "required": ["passed", "max_rel", "rtol"]}}}},
            "outputs": {"type": "object", "required": ["merged", "aligned", "transforms", "report"],
                        "properties": {"merged": {"type": "string"},
                                       "aligned": {"type": "array", "items": {"type": "string"}},
                                       "transforms": {"type": "array", "items": {"type": "string"}},
                                       "report": {"type": "string"}}},
        },
    }


__all__ = ["SCHEMA_ID", "build_report", "report_schema"]
