"""Groups: small, canonical, hashable objects with a round-trippable text form.

>>> from symspec.groups import parse
>>> g = parse("OC(4)")
>>> e = g.sample(0)
>>> g.contains(e)
True
>>> str(parse("RoPE(8, rot=4)"))
'RoPE(8, rot=4)'
"""

from .base import (
    ALIASES,
    REGISTRY,
    VARIANCES,
    Element,
    Group,
    Path,
    Variance,
    make_generator,
    registry_summary,
)
from .classic import SP, Id, S
from .continuous import GL, OC, D, DiagonalGroup, Dpos, O, RoPE, centred_basis
from .experts import Experts
from .heads import Heads
from .semiperm import SemiPermutation
from .tables import NoEntry, has_entry, kind_entry, missing_entry
from .text import parse

__all__ = [
    "ALIASES",
    "GL",
    "OC",
    "REGISTRY",
    "SP",
    "VARIANCES",
    "D",
    "DiagonalGroup",
    "Dpos",
    "Element",
    "Experts",
    "Group",
    "Heads",
    "Id",
    "NoEntry",
    "O",
    "Path",
    "RoPE",
    "S",
    "SemiPermutation",
    "Variance",
    "centred_basis",
    "has_entry",
    "kind_entry",
    "make_generator",
    "missing_entry",
    "parse",
    "registry_summary",
]
