"""Permutations by linear assignment: S(n), and SP(n) by a signed assignment.

For a permutation P (``y[i] = x[perm[i]]``) every variance acts the same way, and
``||a - P b||^2 = ||a||^2 + ||b||^2 - 2 sum_i C[i, perm[i]]`` with ``C = sum w a b^T``:
the best permutation is a maximum-weight assignment on ``C``. Assignments run on the
CPU with scipy (exact; batched GPU assignment is rarely faster, DESIGN §3).
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
from scipy.optimize import linear_sum_assignment  # type: ignore[import-untyped]

from ...groups import DiagonalGroup, Element, Group
from ..engine.base import (
    DiagStatTerm,
    SolveContext,
    SolverError,
    Term,
    joint_solver,
    require_variances,
    solver,
    solver_for,
)
from . import smooth  # the module: its best_scale_value is looked up at each call (bench swaps it)


def assign(score: torch.Tensor, ctx: SolveContext | None = None) -> torch.Tensor:
    """Maximum-weight assignment per batch entry: ``perm[..., i]`` is the column of row i.

    >>> assign(torch.tensor([[0.0, 5.0], [4.0, 1.0]])).tolist()
    [1, 0]
    """
    batch = score.shape[:-2]
    n = score.shape[-1]
    if not bool(torch.isfinite(score).all()):
        raise SolverError("the assignment scores are not finite (NaN or inf weights?)")
    # scipy minimises float64 costs: hand it -score in float64 directly (its maximize=True
    # would copy and negate again: 0.1 s per 3072 x 3072 assignment, more than the
    # assignment itself once the units are nearly matched)
    cost = score.detach().to("cpu", torch.float64, copy=True).neg_().reshape(-1, n, n).numpy()
    out = np.empty((cost.shape[0], n), dtype=np.int64)
    for k in range(cost.shape[0]):
        rows, cols = linear_sum_assignment(cost[k])
        out[k, rows] = cols
    return torch.from_numpy(out).reshape(*batch, n).to(score.device)


def _sum_cross(terms: list[Term], variances: set[str]) -> torch.Tensor | None:
    total = None
    for t in terms:
        if t.variance in variances:
            total = t.cross() if total is None else total + t.cross()
    return total


@solver("S", cheap_apply=True, variance_free=True)
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


# ---------------------------------------------------------------------------------------
# a global sign, and pairs solved jointly


@solver("Sign", cheap_apply=True, batched=True)
def solve_sign(group: Group, terms: list[Term], current: Element, ctx: SolveContext) -> Element:
    """A global sign s in {1, -1}: -2 s tr(C) is smallest for s = sign(tr C)."""
    tr = _sum_cross(terms, {"co", "contra"})
    if tr is None:
        return current
    t = torch.diagonal(tr, dim1=-2, dim2=-1).sum(-1)
    return {"sign": torch.where(t < 0, -1.0, 1.0).to(dtype=current["sign"].dtype, device=current["sign"].device)}


def _diag_term(variance: str, c: torch.Tensor, g: torch.Tensor, rows: torch.Tensor) -> DiagStatTerm:
    return DiagStatTerm((), variance, c, g, rows)


@joint_solver(("S", "D"), ("S", "Dpos"))
def solve_permuted_scaling(outer: Group, inner: Group, terms: list[Term], current: tuple[Element, Element],
                           ctx: SolveContext) -> tuple[Element, Element]:
    """A permutation P and the diagonal D acting right before it (``mlp[i] @ scale[i]``):
    coordinate descent between the two locks in wrong matches (a unit's scale, fitted to
    the wrong partner, keeps it there), so they are solved together.

    The assignment scores a pair (new unit i, old unit j) by how well it fits with its own
    scale: the permutation-only terms' correlation plus the scaled terms' value at one
    scale d for both sides (:func:`scaled_pair_score`; exact for planted pairs, a value
    some scale attains otherwise). Given the permutation, the scales are solved exactly.
    """
    require_variances(outer, terms, {"co", "contra", "abs"})
    if not isinstance(inner, DiagonalGroup):
        raise SolverError(f"a permutation with {inner} right before it is not a permuted scaling")
    e_perm, e_diag = current
    score = scaled_pair_score(terms, inner)
    if score is None:
        perm = e_perm["perm"]
    else:
        with ctx.timer("assign"):
            perm = assign(score, ctx)
    return {"perm": perm}, scales_given(perm, terms, inner, e_diag, ctx)


#: entries of the pair score computed at once: the per-pair scale makes dozens of passes
#: over a dozen temporaries of this many entries (:class:`.smooth.ScaleWork`, kept from one
#: chunk to the next), small enough to stay in the cache (2M-entry chunks made fresh
#: temporaries, page-faulted in on every pass: 3x the time on a 4864-unit MLP)
SCORE_CHUNK_ELEMENTS = 1 << 15


def scaled_pair_score(terms: list[Term], inner: DiagonalGroup) -> torch.Tensor | None:
    """How well old unit j fits new unit i with its own best scale (see
    :func:`solve_permuted_scaling`); None when no term scores the permutation.

    The pair's value is ``max_d 2 d C_co - d^2 G_co + 2 C_ct / d - G_ct / d^2`` (plus the
    abs terms with |d|, and the terms the scale acts on alone, which belong to old unit j
    whatever its partner), the co and contra sides fitted with one d
    (:func:`.smooth.best_scale_value`, at the better of the two sides' own optima: exact
    where they agree, as on planted pairs). Fitting each side its own scale (``C^2 / G`` per
    side) is an upper bound that cannot tell apart units that differ only by a scale
    between their two sides: copies of one unit with their outgoing weights shared
    (docs/width.md) all scored alike, and the assignment among them was decided by
    rounding."""
    outer: torch.Tensor | None = None
    sides: dict[str, tuple[torch.Tensor | float, torch.Tensor | float]] = {}
    scaled = False
    for t in terms:
        if t.role == "outer":
            outer = t.cross() if outer is None else outer + t.cross()
            continue
        if t.role == "pair":
            c, g, var = t.cross(), t.gram_diag(), t.inner_variance or "co"
            scaled = True
        elif t.role == "inner":
            c, g, var = t.cross_diag().unsqueeze(-2), t.gram_diag(), t.variance
        else:
            continue
        got = sides.get(var)
        sides[var] = (c, g) if got is None else (got[0] + c, got[1] + g)  # no copy of a lone term's f x f cross
    if not scaled:
        return outer
    ref = next(t.cross() for t in terms if t.role == "pair")
    score = torch.empty(ref.shape, dtype=ref.dtype, device=ref.device)
    rows = max(1, SCORE_CHUNK_ELEMENTS // max(1, ref[..., :1, :].numel()))
    starts = list(range(0, ref.shape[-2], rows))
    workers = min(_cores(), SCORE_WORKERS, len(starts)) if ref.device.type == "cpu" else 1
    if workers > 1:
        # chunks this small run on one core each (below torch's grain, and the solvers run
        # with one torch thread): the other cores take every k-th chunk (the kernels
        # release the GIL; each chunk's result is the same whichever thread computes it)
        with ThreadPoolExecutor(workers) as pool:
            list(pool.map(lambda k: _score_chunks(sides, inner.positive_only, score, starts[k::workers], rows), range(workers)))
    else:
        _score_chunks(sides, inner.positive_only, score, starts, rows)
    if outer is not None and outer.dtype == score.dtype and outer.shape == score.shape:
        return score.add_(outer)
    return score if outer is None else outer + score


#: threads that compute a CPU pair score's chunks (at most the cores this process may use)
SCORE_WORKERS = 4


def _cores() -> int:
    """The CPU cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def _score_chunks(sides: dict[str, tuple[torch.Tensor | float, torch.Tensor | float]], positive: bool, score: torch.Tensor,
                  starts: list[int], rows: int) -> None:
    """The pair score's rows ``r0:r0 + rows`` for every r0 in ``starts``, into ``score``."""
    work = smooth.ScaleWork()
    for r0 in starts:
        coef: dict[str, torch.Tensor | float] = {}
        for var, key in (("co", "co"), ("contra", "ct"), ("abs", "ab")):
            got = sides.get(var)
            if got is None:
                coef[f"c_{key}"] = coef[f"g_{key}"] = 0.0
                continue
            c, g = got  # c [..., n or 1, n] (1: a term of old unit j alone), g [..., n]
            assert isinstance(c, torch.Tensor) and isinstance(g, torch.Tensor)
            coef[f"c_{key}"] = c[..., r0 : r0 + rows, :] if c.shape[-2] > 1 else c
            coef[f"g_{key}"] = g.unsqueeze(-2)
        score[..., r0 : r0 + rows, :] = smooth.best_scale_value(coef, positive, work)


def scales_given(perm: torch.Tensor, terms: list[Term], inner: Group, e_diag: Element, ctx: SolveContext) -> Element:
    """The diagonal's best element once the permutation ``perm`` (over the same units) is fixed."""
    inv = torch.argsort(perm)
    dterms: list[Term] = []
    for t in terms:
        if t.role == "pair":
            c = t.cross()[inv, torch.arange(perm.numel(), device=perm.device)]  # C[pi^-1(j), j]
            dterms.append(_diag_term(t.inner_variance or "co", c, t.gram_diag(), t.rows_sq()[inv]))
        elif t.role == "inner":
            dterms.append(_diag_term(t.variance, t.cross_diag(), t.gram_diag(), t.rows_sq()))
    return solver_for(inner).solve(inner, dterms, e_diag, ctx) if dterms else e_diag


@joint_solver(("Sign", "S"))
def solve_signed_perm_pair(outer: Group, inner: Group, terms: list[Term], current: tuple[Element, Element],
                           ctx: SolveContext) -> tuple[Element, Element]:
    """A global sign right after a permutation (``sgn @ resid``): both signs are tried, each
    with its best permutation; the better pair wins."""
    best: tuple[float, float, torch.Tensor] | None = None
    for sigma in (1.0, -1.0):
        score: torch.Tensor | None = None
        const = 0.0
        for t in terms:
            f = sigma if t.variance != "abs" else 1.0
            c = t.cross()
            if t.role == "pair":
                part = f * c
            elif t.role == "inner":
                part = c
            else:
                const += f * float(torch.diagonal(c).sum())
                continue
            score = part if score is None else score + part
        if score is None:
            perm = current[1]["perm"]
            value = const
        else:
            with ctx.timer("assign"):
                perm = assign(score, ctx)
            value = const + float(torch.gather(score, -1, perm.unsqueeze(-1)).sum())
        if best is None or value > best[0]:
            best = (value, sigma, perm)
    assert best is not None
    sign = current[0]["sign"]
    return {"sign": torch.full_like(sign, best[1])}, {"perm": best[2]}
