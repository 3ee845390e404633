"""Solvers: weight matching compiled from the typed problem description.

Every solver sees only a :class:`~symspec.problem.Problem` and state dicts in canonical
form; one solver per group kind is registered in :data:`SOLVERS`. See docs/matching.md.
"""

from . import assignment, heads, orthogonal, smooth  # noqa: F401  (register the solvers)
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
    PERMUTATION_SUBGROUP,
    embed,
    parse_restriction,
    restrict_group,
    restrict_problem,
)
from .smooth import gauss_newton_gl
from .weight import MatchEvent, WeightMatchingResult, match_weights, schedule, working_dtype

__all__ = [
    "MODES",
    "PERMUTATION_SUBGROUP",
    "SOLVERS",
    "MatchEvent",
    "SolveContext",
    "SolverError",
    "StatTerm",
    "Term",
    "Timer",
    "WeightMatchingResult",
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
