"""The built-in alignment methods.

- ``none``: vanilla averaging, the weights as they are (no canonical form, no search);
- ``weight``: weight matching, coordinate descent on ``sum_P ||A_P - g.B_P||^2`` over the
  spec's full groups (:func:`symspec.solvers.match_weights`);
- ``weight-perm``: the same restricted to permutations (the paper's ablation);
- ``universe``: universe matching of the pair (:mod:`symspec.universe.method`);
- ``activation``, ``weight+activation``, ``weight-tokens``: the data-driven methods
  (:mod:`.activation`);
- ``learned``: learned matching, the element trained for the loss of the interpolated
  model (:mod:`.learned`); ``learned-perm``: the same over the permutations only, learned
  with a straight-through estimator (the paper's ablation).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import attrs

from ..universe.method import UniverseMatching
from .activation import ActivationMatching, TokenWeightedMatching
from .learned import LearnedMatching
from .method import Alignment, AlignOptions, Endpoint
from .registry import register_method

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
    """Weight matching (data-free): see :mod:`symspec.solvers.weight`. ``options.tuning``
    is a :class:`~symspec.solvers.WeightOptions` (None: its defaults)."""

    name: str = "weight"
    label: str = "weight matching"
    canonical: bool = True
    needs_data: bool = False
    needs_module: bool = False
    groups: str | None = None
    #: its objective before the first round is the squared weight distance of A and B
    objective_is_distance: bool = True

    def align(self, problem: Problem, a: Endpoint, b: Endpoint, options: AlignOptions) -> Alignment:
        from ..solvers import WeightOptions, match_weights

        tuning = attrs.evolve(options.tuning or WeightOptions(), own_b=options.consume_b)
        res = match_weights(problem, a.state, b.state, rounds=options.rounds, tol=options.tol,
                            device=options.device, dtype=options.dtype, init=options.init,
                            progress=options.progress, timer=options.timer, options=tuning)
        return Alignment(res.elements, res.history, res.timings, res.converged, res.aligned)


NONE = register_method(NoAlignment())
WEIGHT = register_method(WeightMatching())
WEIGHT_PERM = register_method(WeightMatching(name="weight-perm", label="weight matching, permutations only",
                                             groups="perm"))
UNIVERSE = register_method(UniverseMatching())
ACTIVATION = register_method(ActivationMatching())
WEIGHT_ACTIVATION = register_method(ActivationMatching(name="weight+activation", label="weight + activation matching",
                                                       combine=True))
WEIGHT_TOKENS = register_method(TokenWeightedMatching())
LEARNED = register_method(LearnedMatching())
LEARNED_PERM = register_method(LearnedMatching(name="learned-perm", label="learned matching, permutations only",
                                               groups="perm", permutations="ste"))

#: what ``symspec match``/``merge`` align with when given ``--data`` and no ``--method``:
#: the data-driven method with the lowest loss barrier on the LMC benchmark's trained
#: pairs (README, ``python bench/lmc_table.py``)
DATA_DEFAULT = WEIGHT_ACTIVATION.name
