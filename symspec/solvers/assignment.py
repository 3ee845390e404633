"""Permutations by linear assignment: S(n), and SP(n) by a signed assignment.

For a permutation P (``y[i] = x[perm[i]]``) every variance acts the same way, and
``||a - P b||^2 = ||a||^2 + ||b||^2 - 2 sum_i C[i, perm[i]]`` with ``C = sum w a b^T``:
the best permutation is a maximum-weight assignment on ``C``. Assignments run on the
CPU with scipy (exact; batched GPU assignment is rarely faster, DESIGN §3).
"""

from __future__ import annotations

import numpy as np
import torch
from scipy.optimize import linear_sum_assignment

from ..groups import Element, Group
from .base import SolveContext, SolverError, Term, require_variances, solver


def assign(score: torch.Tensor, ctx: SolveContext | None = None) -> torch.Tensor:
    """Maximum-weight assignment per batch entry: ``perm[..., i]`` is the column of row i.

    >>> assign(torch.tensor([[0.0, 5.0], [4.0, 1.0]])).tolist()
    [1, 0]
    """
    batch = score.shape[:-2]
    n = score.shape[-1]
    flat = score.detach().to("cpu", torch.float64).reshape(-1, n, n).numpy()
    if not np.isfinite(flat).all():
        raise SolverError("the assignment scores are not finite (NaN or inf weights?)")
    out = np.empty((flat.shape[0], n), dtype=np.int64)
    for k in range(flat.shape[0]):
        rows, cols = linear_sum_assignment(flat[k], maximize=True)
        out[k, rows] = cols
    return torch.from_numpy(out).reshape(*batch, n).to(score.device)


def _sum_cross(terms: list[Term], variances: set[str]) -> torch.Tensor | None:
    total = None
    for t in terms:
        if t.variance in variances:
            total = t.cross() if total is None else total + t.cross()
    return total


@solver("S", cheap_apply=True)
def solve_permutation(group: Group, terms: list[Term], current: Element, ctx: SolveContext) -> Element:
    score = _sum_cross(terms, {"co", "contra", "abs"})
    if score is None:
        return current
    with ctx.timer("assign"):
        return {"perm": assign(score, ctx)}


@solver("SP", cheap_apply=True)
def solve_signed_permutation(group: Group, terms: list[Term], current: Element, ctx: SolveContext) -> Element:
    """rho(g) = diag(s) P: co and contra terms see the signs, abs terms only P; so the
    assignment runs on |C_signed| + C_abs and each sign follows C_signed at its match."""
    require_variances(group, terms, {"co", "contra", "abs"})
    signed = _sum_cross(terms, {"co", "contra"})
    unsigned = _sum_cross(terms, {"abs"})
    if signed is None and unsigned is None:
        return current
    ref = signed if signed is not None else unsigned
    assert ref is not None
    score = (signed.abs() if signed is not None else 0) + (unsigned if unsigned is not None else 0)
    with ctx.timer("assign"):
        perm = assign(score, ctx)  # type: ignore[arg-type]
    if signed is None:
        sign = torch.ones(perm.shape, dtype=current["sign"].dtype, device=perm.device)
    else:
        matched = torch.gather(signed, -1, perm.unsqueeze(-1)).squeeze(-1)
        sign = torch.where(matched < 0, -1.0, 1.0).to(dtype=current["sign"].dtype)
    return {"perm": perm, "sign": sign.to(current["sign"].device)}
