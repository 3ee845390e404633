"""Solvers: weight matching compiled from the typed problem description.

Every solver sees only a :class:`~symspec.problem.Problem` and statistics (by default of
state dicts in canonical form, :mod:`.statistics`); one solver per group kind is
registered in :data:`SOLVERS`. The engine: :mod:`.weight` (the entry point),
:mod:`.descent`, :mod:`.execution`. See docs/matching.md.
"""

from . import assignment, experts, heads, orthogonal, smooth  # noqa: F401  (register the solvers)
from .assignment import assign
from .base import (
    SOLVERS,
    SolveContext,
    SolverError,
    StatTerm,
    Term,
    Timer,
    objective,
    solver,
    solver_for,
)
from .orthogonal import procrustes
from .restrict import (
    MODES,
    embed,
    parse_restriction,
    restrict_group,
    restrict_problem,
)
from .smooth import gauss_newton_gl
from .statistics import ProviderFactory, StatisticsProvider, Trial, Value
from .weight import (
    MatchEvent,
    WeightMatchingResult,
    WeightOptions,
    match_weights,
    schedule,
    working_dtype,
)

__all__ = [
    "MODES",
    "SOLVERS",
    "MatchEvent",
    "ProviderFactory",
    "SolveContext",
    "SolverError",
    "StatTerm",
    "StatisticsProvider",
    "Term",
    "Timer",
    "Trial",
    "Value",
    "WeightMatchingResult",
    "WeightOptions",
    "assign",
    "embed",
    "gauss_newton_gl",
    "match_weights",
    "objective",
    "parse_restriction",
    "procrustes",
    "restrict_group",
    "restrict_problem",
    "schedule",
    "solver",
    "solver_for",
    "working_dtype",
]
