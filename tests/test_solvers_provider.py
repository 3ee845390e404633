"""The statistics-provider seam: a provider that is not the weights' (precomputed
statistics per space, as activation matching has them) runs in the same coordinate
descent and solvers, through ``match_weights(..., provider=...)``."""

from __future__ import annotations

from collections.abc import Mapping, Set

import pytest
import torch

from symspec.errors import SymspecInputError
from symspec.groups import O, S
from symspec.problem import Problem, SpaceInstance
from symspec.solvers import (
    SolveContext,
    StatTerm,
    Term,
    Trial,
    Value,
    WeightOptions,
    match_weights,
    objective,
)
from symspec.solvers.engine.statistics import same_element


class SiteStatistics:
    """Per space, the statistics of features at one site, x_A ~ rho(g) x_B: a StatTerm
    each, and the objective per space from it (:func:`symspec.solvers.objective`)."""

    def __init__(self, problem: Problem, ctx: SolveContext, init: Mapping[str, dict[str, torch.Tensor]] | None,
                 xa: Mapping[str, torch.Tensor], xb: Mapping[str, torch.Tensor]) -> None:
        self.problem = problem
        self.stats = {s: StatTerm((), "co", xa[s] @ xb[s].mT, xb[s] @ xb[s].mT, xa[s].square().sum(-1)) for s in xa}
        self.load({s: (init or {}).get(s) or si.group.identity(dtype=ctx.dtype) for s, si in problem.spaces.items()})

    def _value(self, s: str, e: dict[str, torch.Tensor]) -> Value:
        v = float(objective(self.problem.spaces[s].group, [self.stats[s]], e))
        return Value(v, 1e-12 * abs(v))

    def active(self, space: str) -> bool:
        return True

    def pairs(self) -> dict[str, str]:
        return {}

    def terms(self, space: str, partner: str | None = None, trusted: Set[str] | None = None) -> list[Term]:
        return [self.stats[space]]

    def objective(self) -> Mapping[str, Value]:
        return self.values

    def evaluate(self, news: Mapping[str, dict[str, torch.Tensor]]) -> Trial | None:
        new = {s: e for s, e in news.items() if not same_element(e, self.elements[s])}
        if not new:
            return None
        return Trial(tuple(self.values[s] for s in new), tuple(self._value(s, e) for s, e in new.items()), new)

    def commit(self, trial: Trial) -> None:
        for s, e in trial.state.items():
            self.elements[s] = e
            self.values[s] = self._value(s, e)

    def load(self, elements: Mapping[str, dict[str, torch.Tensor]]) -> None:
        self.elements = dict(elements)
        self.values = {s: self._value(s, e) for s, e in self.elements.items()}


def test_a_provider_of_precomputed_statistics_runs_in_the_same_descent() -> None:
    gen = torch.Generator().manual_seed(4)
    problem = Problem({"resid": SpaceInstance("resid", "resid", None, O(4)),
                       "ff": SpaceInstance("ff", "ff", None, S(5))}, {})
    q, p = O(4).sample(1), S(5).sample(2)
    xb = {"resid": torch.randn(4, 30, generator=gen, dtype=torch.float64),
          "ff": torch.randn(5, 30, generator=gen, dtype=torch.float64)}
    xa = {"resid": O(4).apply(q, xb["resid"]), "ff": S(5).apply(p, xb["ff"])}
    made: list[SiteStatistics] = []

    def factory(problem: Problem, ctx: SolveContext, init: Mapping[str, dict[str, torch.Tensor]] | None) -> SiteStatistics:
        made.append(SiteStatistics(problem, ctx, init, xa, xb))
        return made[-1]

    res = match_weights(problem, {}, {}, rounds=3, tol=0.0, provider=factory)
    assert len(made) == 1 and res.aligned is None
    assert torch.allclose(res.elements["resid"]["matrix"], q["matrix"], atol=1e-10)
    assert torch.equal(res.elements["ff"]["perm"], p["perm"])
    assert res.history[0] > 1.0 and abs(res.history[-1]) < 1e-12 * res.history[0]  # float64 cancellation of the statistics
    assert res.converged
    # negative case: B's tensors can only be taken over by the weights' own statistics
    with pytest.raises(SymspecInputError, match="own_b"):
        match_weights(problem, {}, {}, provider=factory, options=WeightOptions(own_b=True))
