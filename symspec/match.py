"""Weight matching of two models under a spec (data-free): ``align(..., method="weight")``.

>>> import symspec.match  # doctest: +SKIP
>>> res = symspec.match.weight_match(model_a, model_b, "nanogpt")  # doctest: +SKIP
>>> res.history  # the objective before the first round, then after each  # doctest: +SKIP

The pipeline (bind, canonicalise, restrict, solve, transform, record) lives in
:mod:`symspec.alignment`, shared by every method; this module keeps the names that
weight-matching code and the docs use.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from .alignment import AlignResult, align, canonical_module, check_same_problem, weight_distance
from .alignment.api import ModelLike
from .binding import BoundSpec
from .solvers import MatchEvent, WeightOptions
from .spec.model import Spec
from .statedict import check_finite, interpolate_state_dicts

#: the result of :func:`weight_match` (any method's result is an :class:`AlignResult`)
MatchResult = AlignResult


def weight_match(model_a: ModelLike, model_b: ModelLike, spec: Spec | BoundSpec | str | Path, *,
                 groups: str | Mapping[str, str] | None = None, rounds: int = 10, tol: float = 1e-6,
                 device: str | torch.device = "cpu", dtype: torch.dtype | None = None,
                 progress: Any = None, config: Any = None, keep_canonical_b: bool = True,
                 options: WeightOptions | None = None) -> AlignResult:
    """Align ``model_b`` to ``model_a`` in weight space under ``spec``: :func:`symspec.align`
    with ``method="weight"`` (see there for the arguments). ``options``: the solver's
    knobs (Gauss-Newton steps, greedy start, assignment threads, overlap)."""
    return align(model_a, model_b, spec, method="weight", groups=groups, rounds=rounds, tol=tol, device=device,
                 dtype=dtype, progress=progress, config=config, keep_canonical_b=keep_canonical_b, options=options)


__all__ = ["MatchEvent", "MatchResult", "canonical_module", "check_finite", "check_same_problem",
           "interpolate_state_dicts", "weight_distance", "weight_match"]
