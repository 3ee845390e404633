"""Solvers: weight matching compiled from the typed problem description.

Two parts, by job:

- :mod:`.engine`: the weight-matching engine. Terms and the solver registry
  (:mod:`.engine.base`), statistics providers (:mod:`.engine.statistics`, of state dicts in
  canonical form by default), acting and rounding, coordinate descent
  (:mod:`.engine.descent`), execution, :func:`match_weights` (:mod:`.engine.weight`, the
  entry point) and restricted groups (:mod:`.engine.restrict`);
- :mod:`.kinds`: one solver per group kind, registered in :data:`SOLVERS` (assignment,
  orthogonal, smooth, heads, experts).

Every solver sees only a :class:`~symspec.problem.Problem` and statistics.
:mod:`.convex` wraps cvxpy for the relaxations. Certificates are :mod:`symspec.certify`,
learned matching's parametrisations :mod:`symspec.learned.parametrize`. See
docs/matching.md.
"""

from . import kinds  # noqa: F401  (registers the per-kind solvers)
from .engine.base import (
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
from .engine.restrict import (
    MODES,
    embed,
    parse_restriction,
    restrict_group,
    restrict_problem,
)
from .engine.statistics import ProviderFactory, StatisticsProvider, Trial, Value
from .engine.weight import (
    MatchEvent,
    WeightMatchingResult,
    WeightOptions,
    match_weights,
    schedule,
    working_dtype,
)
from .kinds.assignment import assign
from .kinds.orthogonal import procrustes
from .kinds.smooth import gauss_newton_gl

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
