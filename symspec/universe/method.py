"""Universe matching as a pair alignment method (``"universe"`` in the registry), so that
``symspec barrier --align universe``, ``symspec match --method universe`` and the
paper-table benchmark offer it like any other method.

Both endpoints are matched into their universe (:func:`~symspec.universe.state_universe`,
in this process) and B's element is returned relative to A's: ``g_A^-1 g_B`` per space.
The group acts linearly on the weights, so the path from A to ``g_A^-1 g_B·B`` is the
path from ``g_A·A`` to ``g_B·B`` (which passes through the merged model at λ = 1/2)
seen in A's frame: the same losses.

>>> from symspec.alignment import get_method
>>> get_method("universe").label
'universe matching'
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import attrs

from ..alignment.protocol import Alignment, AlignOptions, Endpoint
from ..errors import SymspecInputError

if TYPE_CHECKING:
    from ..problem import Problem


@attrs.frozen
class UniverseOptions:
    """The universe method's own knobs (``AlignOptions.tuning``): at most ``rounds``
    universe rounds, fewer once one gains less than ``tol`` (relative); ``method``: the
    registered method aligning each endpoint onto the universe, with ``max_iter``
    Gauss-Newton steps; ``threads``: torch threads per alignment (0: as they are). The
    common options' ``rounds``/``tol`` are each alignment's."""

    rounds: int = 10
    tol: float = 1e-4
    method: str = "weight"
    max_iter: int = 10
    threads: int = 0


@attrs.frozen
class UniverseMatching:
    """Universe matching of a pair: see the module's docstring."""

    name: str = "universe"
    label: str = "universe matching"
    canonical: bool = True
    needs_data: bool = False
    needs_module: bool = False
    groups: str | None = None

    def align(self, problem: Problem, a: Endpoint, b: Endpoint, options: AlignOptions) -> Alignment:
        # deferred: this module is imported when methods are listed (no torch)
        from .api import state_universe

        tuning = options.tuning if options.tuning is not None else UniverseOptions()
        if not isinstance(tuning, UniverseOptions):
            raise SymspecInputError(f"the universe method's options are a UniverseOptions, not {type(tuning).__name__}")
        found = state_universe(problem, [a.state, b.state], method=tuning.method, rounds=tuning.rounds,
                               tol=tuning.tol, device=str(options.device), dtype=options.dtype,
                               match_rounds=options.rounds, match_tol=options.tol, max_iter=tuning.max_iter,
                               threads=tuning.threads)
        return Alignment(found.between(1, 0), found.history, converged=found.converged,
                         info={"aligned_with": tuning.method, "universe_rounds": len(found.rounds)})


__all__ = ["UniverseMatching", "UniverseOptions"]
