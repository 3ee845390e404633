"""Permutations by linear assignment: S(n), and SP(n) by a signed assignment.

For a permutation P (``y[i] = x[perm[i]]``) every variance acts the same way, and
``||a - P b||^2 = ||a||^2 + ||b||^2 - 2 sum_i C[i, perm[i]]`` with ``C = sum w a b^T``:
the best permutation is a maximum-weight assignment on ``C``. Assignments run on the
CPU with scipy (exact; batched GPU assignment is rarely faster, DESIGN §3).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
from scipy.optimize import linear_sum_assignment  # type: ignore[import-untyped]
from scipy.sparse import csr_matrix  # type: ignore[import-untyped]
from scipy.sparse.csgraph import min_weight_full_bipartite_matching  # type: ignore[import-untyped]

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
    # scipy minimises float64 costs: hand it -score in float64 directly, in one pass (its
    # maximize=True would copy and negate again: 0.1 s per 3072 x 3072 assignment, more
    # than the assignment itself once the units are nearly matched)
    cost_t = torch.mul(score.detach().to("cpu"), -1.0, out=torch.empty(score.shape, dtype=torch.float64))
    low, high = torch.aminmax(cost_t)  # NaN propagates to the extremes; no n x n mask is made
    if not (math.isfinite(float(low)) and math.isfinite(float(high))):
        raise SolverError("the assignment scores are not finite (NaN or inf weights?)")
    cost = cost_t.reshape(-1, n, n).numpy()
    out = np.empty((cost.shape[0], n), dtype=np.int64)
    for k in range(cost.shape[0]):
        rows, cols = linear_sum_assignment(cost[k])
        out[k, rows] = cols
    return torch.from_numpy(out).reshape(*batch, n).to(score.device)


def assign_sparse(n: int, rows: torch.Tensor, cols: torch.Tensor, values: torch.Tensor) -> torch.Tensor | None:
    """The maximum-weight assignment of n rows to n columns using only the pairs
    ``(rows[k], cols[k])``, worth ``values[k]`` (distinct pairs); None when no complete
    assignment uses them alone. A sparse assignment (scipy's LAPJVsp): on an n x n problem
    with a few dozen pairs per row, a hundredth of a dense one's time.

    >>> assign_sparse(2, torch.tensor([0, 1, 1]), torch.tensor([0, 0, 1]), torch.tensor([0.0, 4.0, 1.0])).tolist()
    [0, 1]
    >>> assign_sparse(2, torch.tensor([0, 1]), torch.tensor([0, 0]), torch.tensor([1.0, 1.0])) is None
    True
    """
    v = values.detach().to("cpu", torch.float64)
    if not bool(torch.isfinite(v).all()):
        raise SolverError("the assignment scores are not finite (NaN or inf weights?)")
    # every complete assignment has n pairs: a common shift changes none of their order,
    # and makes every weight positive (a stored zero would be no pair at all)
    v = v - float(v.min()) + 1.0 if v.numel() else v
    graph = csr_matrix((v.numpy(), (rows.cpu().numpy(), cols.cpu().numpy())), shape=(n, n))
    try:
        r, c = min_weight_full_bipartite_matching(graph, maximize=True)
    except ValueError:  # no complete assignment within these pairs
        return None
    out = np.empty(n, dtype=np.int64)
    out[r] = c
    return torch.from_numpy(out).to(rows.device)


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
    some scale attains otherwise), on each unit's most promising pairs where the layer is
    wide (:func:`assign_scaled`). Given the permutation, the scales are solved exactly.
    """
    require_variances(outer, terms, {"co", "contra", "abs"})
    if not isinstance(inner, DiagonalGroup):
        raise SolverError(f"a permutation with {inner} right before it is not a permuted scaling")
    e_perm, e_diag = current
    perm = assign_scaled(terms, inner, ctx)
    if perm is None:
        perm = e_perm["perm"]
    return {"perm": perm}, scales_given(perm, terms, inner, e_diag, ctx)


#: entries of the pair score computed at once: the per-pair scale makes dozens of passes
#: over a dozen temporaries of this many entries (:class:`.smooth.ScaleWork`, kept from one
#: chunk to the next), small enough to stay in the cache (2M-entry chunks made fresh
#: temporaries, page-faulted in on every pass: 3x the time on a 4864-unit MLP)
SCORE_CHUNK_ELEMENTS = 1 << 15

#: a permutation-and-scaling layer of at least this many units scores exactly only each
#: unit's most promising pairs (:func:`assign_scaled`); a narrower one scores every pair
PRUNE_UNITS = 1024
#: how many pairs per unit, as a row (new unit) and as a column (old unit), are scored
#: exactly: those with the highest per-side upper bound
PRUNE_CANDIDATES = 64

Sides = dict[str, tuple[torch.Tensor | float, torch.Tensor | float]]


def _score_parts(terms: list[Term]) -> tuple[torch.Tensor | None, Sides, torch.Tensor | None]:
    """What the pair score is made of: the permutation-only terms' correlation (``outer``),
    per variance of the scaled side the summed cross [..., n or 1, n] and Gram diagonal
    [..., n], and one pair term's cross (the score's shape; None: nothing is scaled)."""
    outer: torch.Tensor | None = None
    sides: Sides = {}
    ref: torch.Tensor | None = None
    for t in terms:
        if t.role == "outer":
            outer = t.cross() if outer is None else outer + t.cross()
            continue
        if t.role == "pair":
            c, g, var = t.cross(), t.gram_diag(), t.inner_variance or "co"
            ref = c if ref is None else ref
        elif t.role == "inner":
            c, g, var = t.cross_diag().unsqueeze(-2), t.gram_diag(), t.variance
        else:
            continue
        got = sides.get(var)
        sides[var] = (c, g) if got is None else (got[0] + c, got[1] + g)  # no copy of a lone term's f x f cross
    return outer, sides, ref


def scaled_pair_score(terms: list[Term], inner: DiagonalGroup) -> torch.Tensor | None:
    """How well old unit j fits new unit i with its own best scale (see
    :func:`solve_permuted_scaling`), for every pair; None when no term scores the
    permutation.

    The pair's value is ``max_d 2 d C_co - d^2 G_co + 2 C_ct / d - G_ct / d^2`` (plus the
    abs terms with |d|, and the terms the scale acts on alone, which belong to old unit j
    whatever its partner), the co and contra sides fitted with one d
    (:func:`.smooth.best_scale_value`, at the better of the two sides' own optima: exact
    where they agree, as on planted pairs). Fitting each side its own scale (``C^2 / G`` per
    side) is an upper bound that cannot tell apart units that differ only by a scale
    between their two sides: copies of one unit with their outgoing weights shared
    (docs/width.md) all scored alike, and the assignment among them was decided by
    rounding."""
    outer, sides, ref = _score_parts(terms)
    if ref is None:
        return outer
    score = _chunked(smooth.best_scale_value, sides, inner.positive_only, ref)
    if outer is not None and outer.dtype == score.dtype and outer.shape == score.shape:
        return score.add_(outer)
    return score if outer is None else outer + score


def assign_scaled(terms: list[Term], inner: DiagonalGroup, ctx: SolveContext) -> torch.Tensor | None:
    """The best assignment on :func:`scaled_pair_score` (None when no term scores the
    permutation). On a layer of ``PRUNE_UNITS`` units or more, the score is computed
    exactly only for each new unit's and each old unit's ``PRUNE_CANDIDATES`` pairs with
    the highest per-side upper bound (:func:`.smooth.scale_value_bound`, a few passes
    against the score's dozens), and the assignment is restricted to those pairs. A pair
    left out is never worth more than its bound, which is below the bounds of the unit's
    candidates; on planted pairs the bound is exact, so the true partners are always
    among them. Should no complete assignment exist within the candidates, every pair is
    scored. (bench/bench_pair_score.py measures both ways: time, and agreement of the
    assignments.)"""
    outer, sides, ref = _score_parts(terms)
    if ref is None:
        if outer is None:
            return None
        with ctx.timer("assign"):
            return assign(outer, ctx)
    n = ref.shape[-1]
    if ref.ndim == 2 and n >= max(PRUNE_UNITS, 4 * PRUNE_CANDIDATES):
        with ctx.timer("score"):
            rows, cols, values = pruned_pair_score(outer, sides, inner.positive_only, ref, PRUNE_CANDIDATES)
        with ctx.timer("assign"):
            perm = assign_sparse(n, rows, cols, values)
        if perm is not None:
            return perm
        # no complete assignment within the candidates: every pair is scored
    with ctx.timer("score"):
        full = scaled_pair_score(terms, inner)
    assert full is not None
    with ctx.timer("assign"):
        return assign(full, ctx)


def pruned_pair_score(outer: torch.Tensor | None, sides: Sides, positive: bool, ref: torch.Tensor,
                      k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The pair score on each row's and each column's ``k`` pairs of highest upper bound
    (:func:`.smooth.scale_value_bound` plus the permutation-only correlation), as
    (rows, cols, values) of the distinct pairs; ``ref`` [n, n] gives the shape."""
    bound = _chunked(smooth.scale_value_bound, sides, positive, ref)
    if outer is not None:
        bound = bound.add_(outer) if outer.dtype == bound.dtype else bound + outer
    rows, cols = candidates(bound, k)
    del bound
    coef = _coefs(sides, lambda c: c[rows, cols] if c.shape[-2] > 1 else c[0, cols], lambda g: g[cols])
    values = smooth.best_scale_value(coef, positive)
    if outer is not None:
        values = values + outer[rows, cols]
    return rows, cols, values


def candidates(score: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The distinct pairs (rows, cols) among each row's and each column's ``k`` highest
    entries of ``score`` [n, n].

    >>> r, c = candidates(torch.tensor([[3.0, 1.0, 0.0], [2.0, 5.0, 1.0], [0.0, 4.0, 9.0]]), 1)
    >>> sorted(zip(r.tolist(), c.tolist()))
    [(0, 0), (1, 1), (2, 2)]
    """
    n = score.shape[-1]
    by_row = _topk(score, k, 1)  # [n, k]: each new unit's best old units
    by_col = _topk(score, k, 0)  # [k, n]: each old unit's best new units
    ar = torch.arange(n, device=score.device)
    flat = torch.cat([(ar[:, None] * n + by_row).flatten(), (by_col * n + ar[None, :]).flatten()]).unique()
    return flat // n, flat % n


def _topk(score: torch.Tensor, k: int, dim: int) -> torch.Tensor:
    """The indices of the ``k`` highest entries of ``score`` [n, n] along ``dim``, the other
    axis split among threads on the CPU (the solvers run with one torch thread; each
    part's result is the same whichever thread computes it)."""
    other = 1 - dim
    workers = min(_cores(), SCORE_WORKERS, score.shape[other]) if score.device.type == "cpu" else 1
    if workers <= 1:
        return score.topk(k, dim=dim, sorted=False).indices
    bounds = [score.shape[other] * i // workers for i in range(workers + 1)]
    with ThreadPoolExecutor(workers) as pool:
        parts = list(pool.map(lambda i: score.narrow(other, bounds[i], bounds[i + 1] - bounds[i]).topk(k, dim=dim, sorted=False).indices,
                              range(workers)))
    return torch.cat(parts, other)


def _chunked(fn: Callable[[dict[str, torch.Tensor | float], bool, smooth.ScaleWork], torch.Tensor], sides: Sides,
             positive: bool, ref: torch.Tensor) -> torch.Tensor:
    """``fn`` (a per-pair value of the sides' coefficients) on every pair [..., n, n], in
    cache-sized chunks of rows, shared by threads on the CPU."""
    out = torch.empty(ref.shape, dtype=ref.dtype, device=ref.device)
    rows = max(1, SCORE_CHUNK_ELEMENTS // max(1, ref[..., :1, :].numel()))
    starts = list(range(0, ref.shape[-2], rows))
    workers = min(_cores(), SCORE_WORKERS, len(starts)) if ref.device.type == "cpu" else 1
    if workers > 1:
        # chunks this small run on one core each (below torch's grain, and the solvers run
        # with one torch thread): the other cores take every k-th chunk (the kernels
        # release the GIL; each chunk's result is the same whichever thread computes it)
        with ThreadPoolExecutor(workers) as pool:
            list(pool.map(lambda k: _score_chunks(fn, sides, positive, out, starts[k::workers], rows), range(workers)))
    else:
        _score_chunks(fn, sides, positive, out, starts, rows)
    return out


#: threads that compute a CPU pair score's chunks (at most the cores this process may use)
SCORE_WORKERS = 4


def _cores() -> int:
    """The CPU cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def _score_chunks(fn: Callable[[dict[str, torch.Tensor | float], bool, smooth.ScaleWork], torch.Tensor], sides: Sides,
                  positive: bool, out: torch.Tensor, starts: list[int], rows: int) -> None:
    """``fn`` on the pairs of rows ``r0:r0 + rows`` for every r0 in ``starts``, into ``out``."""
    work = smooth.ScaleWork()
    for r0 in starts:
        coef = _coefs(sides, lambda c, r0=r0: c[..., r0 : r0 + rows, :] if c.shape[-2] > 1 else c,
                      lambda g: g.unsqueeze(-2))
        out[..., r0 : r0 + rows, :] = fn(coef, positive, work)


def _coefs(sides: Sides, cross: Callable[[torch.Tensor], torch.Tensor],
           gram: Callable[[torch.Tensor], torch.Tensor]) -> dict[str, torch.Tensor | float]:
    """The pair value's coefficients (``c_co``, ``g_co``, ``c_ct``, ...) from the sides'
    summed cross [..., n or 1, n] (1: a term of old unit j alone) and Gram diagonal [..., n],
    each taken by ``cross``/``gram`` (a chunk of rows, the candidate pairs); 0.0 for a
    side without terms."""
    coef: dict[str, torch.Tensor | float] = {}
    for var, key in (("co", "co"), ("contra", "ct"), ("abs", "ab")):
        got = sides.get(var)
        if got is None:
            coef[f"c_{key}"] = coef[f"g_{key}"] = 0.0
            continue
        c, g = got
        assert isinstance(c, torch.Tensor) and isinstance(g, torch.Tensor)
        coef[f"c_{key}"], coef[f"g_{key}"] = cross(c), gram(g)
    return coef


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
