"""The built-in alignment methods.

- ``none``: vanilla averaging, the weights as they are (no canonical form, no search);
- ``weight``: weight matching, coordinate descent on ``sum_P ||A_P - g.B_P||^2`` over the
  spec's full groups (:func:`symspec.solvers.match_weights`);
- ``weight-perm``: the same restricted to permutations (the paper's ablation);
- ``activation``, ``weight+activation``, ``weight-tokens``: the data-driven methods
  (:mod:`.activation`);
- ``auto``: every method that declares itself a ``candidate`` (weight, weight-tokens,
  activation, weight+activation), the one with the lowest midpoint loss kept (:mod:`.auto`).

:mod:`.registry` registers them first. The extensions register their own methods
(``universe``: :mod:`symspec.universe.extension`; ``learned``, ``learned-perm``:
:mod:`symspec.learned.extension`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import attrs

from .activation import ActivationMatching, TokenWeightedMatching
from .auto import AutoMatching
from .protocol import Alignment, AlignOptions, Endpoint

if TYPE_CHECKING:
    from ..problem import Problem


@attrs.frozen
class NoAlignment:
    """Vanilla averaging: B as it is. Works on the raw weights (``canonical=False``), so the
    path it measures is the plain average of the two checkpoints."""

    name: str = "none"
    label: str = "vanilla averaging"
    canonical: bool = False
    needs_data: bool = False
    needs_module: bool = False
    groups: str | None = None

    def align(self, problem: Problem, a: Endpoint, b: Endpoint, options: AlignOptions) -> Alignment:
        return Alignment(elements={}, history=[], converged=True)


@attrs.frozen
class WeightMatching:
    """Weight matching (data-free): see :mod:`symspec.solvers.engine.weight`. ``options.tuning``
    is a :class:`~symspec.solvers.WeightOptions` (None: its defaults)."""

    name: str = "weight"
    label: str = "weight matching"
    canonical: bool = True
    needs_data: bool = False
    needs_module: bool = False
    groups: str | None = None
    #: its objective before the first round is the squared weight distance of A and B
    objective_is_distance: bool = True
    #: ``auto`` tries it
    candidate: bool = True

    def align(self, problem: Problem, a: Endpoint, b: Endpoint, options: AlignOptions) -> Alignment:
        # deferred: methods are listed without torch (CLI help)
        from ..solvers import WeightOptions, match_weights

        tuning = attrs.evolve(options.tuning or WeightOptions(), own_b=options.consume_b)
        res = match_weights(problem, a.state, b.state, rounds=options.rounds, tol=options.tol,
                            device=options.device, dtype=options.dtype, init=options.init,
                            progress=options.progress, timer=options.timer, options=tuning)
        return Alignment(res.elements, res.history, res.timings, res.converged, res.aligned)


AUTO = AutoMatching()
NONE = NoAlignment()
WEIGHT = WeightMatching()
WEIGHT_PERM = WeightMatching(name="weight-perm", label="weight matching, permutations only", groups="perm", candidate=False)
ACTIVATION = ActivationMatching()
WEIGHT_ACTIVATION = ActivationMatching(name="weight+activation", label="weight + activation matching", combine=True)
WEIGHT_TOKENS = TokenWeightedMatching()
#: in the order :mod:`.registry` registers them
BUILTIN = (NONE, WEIGHT, WEIGHT_PERM, ACTIVATION, WEIGHT_ACTIVATION, WEIGHT_TOKENS, AUTO)

#: what ``symspec match``/``merge``/``barrier``/``universe`` align with when given
#: ``--data`` and no ``--method``: ``auto``, which runs the candidates and keeps the one
#: whose midpoint has the lowest validation loss (which method wins depends on the pair)
DATA_DEFAULT = AUTO.name
