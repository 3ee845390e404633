"""The spec language: YAML -> frozen, located data -> validated :class:`Spec`."""

from .builtin import builtin_index, builtin_names, builtin_path, specs_for_class
from .load import dump_spec, load_spec, loads_spec
from .model import (
    AxisExpr,
    Chain,
    DimDecl,
    ParamDecl,
    SpaceDecl,
    Spec,
    StepDecl,
    Term,
    TieDecl,
    parse_axis,
)

__all__ = [
    "AxisExpr",
    "Chain",
    "DimDecl",
    "ParamDecl",
    "SpaceDecl",
    "Spec",
    "StepDecl",
    "Term",
    "TieDecl",
    "builtin_index",
    "builtin_names",
    "builtin_path",
    "dump_spec",
    "load_spec",
    "loads_spec",
    "parse_axis",
    "specs_for_class",
]
