"""Semi-permutation matching: which unit of the narrow model each unit of the wide one
copies, every narrow unit at least once.

Given a cost c[k, j] of giving wide unit k a copy of narrow unit j (n_A >= n_B), choose an
owner for each k, covering every j, at the least total cost:

    min sum_k c[k, owner(k)]  s.t.  every j is some k's owner.

Three ways, on the same problems (``method``):

- ``exact``: write the total as sum_k min_j c[k, j] + sum_{k in M} r[k, m(k)], with the
  reduced cost r[k, j] = c[k, j] - min_j' c[k, j'] >= 0 and M the wide units chosen as the
  first copy of each narrow unit (one each). The first sum is fixed; the second is a
  rectangular assignment (Hungarian) on r; every other unit takes its nearest narrow
  unit, at reduced cost 0. So this is optimal.
- ``lp``: the linear-programming relaxation, 0 <= X <= 1, rows summing to 1, columns to at
  least 1, solved with cvxpy (an open solver: HiGHS, Clarabel or SCS) and rounded row by
  row. Its optimum is a lower bound on the integer optimum (a certificate): the constraint
  matrix is a bipartite incidence matrix, totally unimodular, so the bound is tight and
  a vertex solution is integral; ``lp`` reports the bound with the rounded assignment.
- ``greedy``: the Hungarian step on the raw costs, then every other unit to its nearest:
  what a first implementation does, and not optimal (the raw costs pick the first copies,
  not what they save over the nearest).

``bench/bench_semiperm.py`` compares the three on random problems and on the units of
lifted model pairs.
"""

from __future__ import annotations

import attrs
import torch
from scipy.optimize import linear_sum_assignment

from ..solvers.convex import solve

METHODS = ("exact", "lp", "greedy")


@attrs.frozen
class Assignment:
    owner: torch.Tensor  # wide unit -> narrow unit
    cost: float
    method: str
    #: the LP relaxation's optimum (a lower bound on every assignment's cost), for ``lp``
    bound: float | None = None
    solver: str | None = None


def total(cost: torch.Tensor, owner: torch.Tensor) -> float:
    """The cost of an assignment, accumulated in float64."""
    return float(cost.double()[torch.arange(cost.shape[0]), owner].sum())


def covers(owner: torch.Tensor, n_narrow: int) -> bool:
    return bool(torch.bincount(owner, minlength=n_narrow).min() >= 1)


def semiperm_assignment(cost: torch.Tensor, method: str = "exact") -> Assignment:
    """An owner for every wide unit (rows of ``cost``), every narrow unit (columns) at
    least once (see the module)."""
    if cost.ndim != 2 or cost.shape[0] < cost.shape[1]:
        raise ValueError(f"a semi-permutation needs at least as many wide units as narrow ones, got cost {tuple(cost.shape)}")
    if not torch.isfinite(cost).all():
        raise ValueError("the costs must be finite")
    c = cost.double()
    if method == "exact":
        return _exact(c)
    if method == "greedy":
        return _greedy(c)
    if method == "lp":
        return _lp(c)
    raise ValueError(f"unknown method {method!r}; use one of {', '.join(METHODS)}")


def _first_copies(c: torch.Tensor) -> torch.Tensor:
    rows, cols = linear_sum_assignment(c.cpu().numpy())  # scipy reads host memory; c may be on a GPU
    owner = c.argmin(1)
    owner[torch.as_tensor(rows, device=c.device)] = torch.as_tensor(cols, device=c.device)
    return owner


def _exact(c: torch.Tensor) -> Assignment:
    reduced = c - c.min(1, keepdim=True).values
    owner = _first_copies(reduced)
    return Assignment(owner, total(c, owner), "exact")


def _greedy(c: torch.Tensor) -> Assignment:
    owner = _first_copies(c)
    return Assignment(owner, total(c, owner), "greedy")


def _lp(c: torch.Tensor) -> Assignment:
    import cvxpy as cp  # optional: the convex extra

    na, nb = c.shape
    x = cp.Variable((na, nb), nonneg=True)
    problem = cp.Problem(cp.Minimize(cp.sum(cp.multiply(c.cpu().numpy(), x))),
                         [cp.sum(x, axis=1) == 1, cp.sum(x, axis=0) >= 1, x <= 1])
    solver = next((s for s in ("HIGHS", "CLARABEL", "SCS") if s in cp.installed_solvers()), None)
    if solver is None:
        raise RuntimeError("cvxpy has no LP solver installed (HiGHS, Clarabel or SCS)")
    solve(problem, solver)  # Ctrl-C inside SCS is KeyboardInterrupt, not a failed solve
    if x.value is None:
        raise RuntimeError(f"the LP relaxation did not solve ({problem.status})")
    sol = torch.as_tensor(x.value, device=c.device)
    owner = sol.argmax(1)
    if not covers(owner, nb):  # a fractional optimum (ties): round by the exact method on its support
        owner = _exact(c + (sol < 1e-6).double() * (c.abs().max() + 1)).owner
    return Assignment(owner, total(c, owner), "lp", float(problem.value), solver)
