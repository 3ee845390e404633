"""Per-space bounds: how much each searched space could still improve the objective,
with every other space fixed at the result.

For a space s, F_s(g) = sum of the terms where s acts (its incident segments, every other
space applied at the result's element) is what weight matching's coordinate descent
minimises when it solves s; its terms come from the same statistics
(:class:`~.weight_statistics.WeightStatistics`, in float64). Per searched group:

- *exact*, where F_s is linear in the action matrix and a solver finds its minimum:
  permutations (linear assignment), signed permutations, a global sign, O and OC
  (Procrustes, in the zero-mean subspace for OC), the trivial group; diagonal scalings
  D/Dpos, whose terms separate per unit into
  ``f(d) = k0 - 2 c d + g d^2 - 2 c'/d + g'/d^2`` (co terms d, contra 1/d, abs |d|):
  its minimum over d != 0 (d > 0 for Dpos) is at a real root of the quartic
  ``g d^4 - c d^3 + c' d - g' = 0`` or at a limit, all of which are compared;
  head groups whose within-head parts are trivial, or orthogonal without grouped-query
  sharing: the cost of new head j reading old head i is ``||a_j||^2 + ||b_i||^2 -
  2 fit`` (fit: the trace, or the nuclear norm of the summed dh x dh cross-covariance
  block) and the best head permutation is an assignment on it.
- *relaxation* (a lower bound on min F_s):
  head groups with GL or RoPE parts: every piece of a head pair (the q side with g, the
  k side with g^-T, the v side with g, the output side with g^-1) is given its own
  matrix, the least-squares fit over *all* dh x dh matrices,
  ``||a||^2 - tr(C G^+ C^T)``. Each piece's minimum over all matrices is at most its
  value at the group's element, so the sum of the pieces' minima is at most the
  coupled minimum for every head pairing, and the assignment over the pairings on these
  costs is at most the minimum over (pairing, within-head maps). Grouped-query sharing
  (one within map for several query heads) is relaxed the same way: each piece its own.
  A permutation space acting on two axes of one parameter (``W' = P W P^T``: quadratic
  in P): the doubly stochastic (Birkhoff) relaxation
  ``min_{X in DS} K - 2 <C, X> + sum_r ||A_r X - X B_r||^2`` (equal to F_s at every
  permutation, convex), solved with cvxpy and certified by its Frank-Wolfe bound: for
  convex f and any X, ``min_DS f >= f(X) + min_{Y in DS} <grad f(X), Y - X>``, the last
  minimum a linear assignment (Birkhoff: the vertices of DS are the permutations), so
  the bound never rests on the solver's accuracy. Above ``DS_LIMIT`` units, and for
  other orthogonal groups on two axes: the linear part's exact maximum plus von
  Neumann's ``sum_i s_i(A_r) s_i(B_r)`` for the quadratic part. Any other group:
  each term's least-squares fit over all matrices.
- *not available*: a space that acts after a non-orthogonal map on the same segment (its
  terms would not be F_s), or on two axes of a parameter with a non-orthogonal group.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Mapping
from typing import Any

import attrs
import numpy as np
import torch

from ..groups import DiagonalGroup, Element, Group, Heads, NoEntry, S, missing_entry
from ..problem import Problem
from ..solvers.convex import solve
from ..solvers.engine.acting import transform
from ..solvers.engine.base import SolveContext, SolverError, Term, objective, solver_for
from ..solvers.engine.weight_statistics import WeightStatistics
from ..solvers.kinds.assignment import assign
from ..solvers.kinds.heads import assign_heads, head_blocks, part_terms
from .joint import NEEDS_CVXPY, element_eps, noisy_gap

#: the doubly stochastic relaxation of a quadratic permutation space is solved up to this
#: many units (n^2 variables); above it, the decoupled bound
DS_LIMIT = 48

_EPS = float(torch.finfo(torch.float64).eps)


@attrs.frozen
class SpaceBound:
    """One space's bound given the others: ``value`` (the space's terms at the result),
    ``bound`` (<= the minimum of those terms over the searched group), ``kind`` (exact,
    relaxation, not available) and how it was made (``method``)."""

    space: str
    group: str
    kind: str
    method: str
    value: float | None = None
    bound: float | None = None
    #: the rounding level of value and bound: a gap below it is zero
    noise: float = 0.0
    seconds: float = 0.0
    #: the tighter bound this space would get with cvxpy (empty: none)
    needs_cvxpy: str = ""

    @property
    def gap(self) -> float | None:
        return noisy_gap(self.value, self.bound, self.noise)

    @property
    def optimal(self) -> bool | None:
        """The result is optimal in this space given the others (exact kinds only)."""
        g = self.gap
        if g is None or self.kind != "exact":
            return None
        return g <= self.noise

    def to_dict(self) -> dict[str, Any]:
        g = self.gap
        return {"space": self.space, "group": self.group, "kind": self.kind, "method": self.method,
                "value": self.value, "bound": self.bound, "gap": g,
                "relative_gap": None if g is None or not self.value else g / self.value,
                "optimal": self.optimal, "noise": self.noise, "seconds": round(self.seconds, 4)}


def quadratic_params(problem: Problem) -> dict[str, list[str]]:
    """space -> parameters on which it acts along two different axes."""
    out: dict[str, list[str]] = {}
    for p, pb in problem.params.items():
        per_axis = [{f.space for seg in ab.segments for f in seg.factors} for ab in pb.axes]
        for s in set().union(*per_axis) if per_axis else set():
            if sum(s in ax for ax in per_axis) > 1:
                out.setdefault(s, []).append(p)
    return out


def _after_non_orthogonal(problem: Problem, space: str) -> str | None:
    """A parameter where a non-orthogonal map acts after ``space`` on the same segment
    (the terms then undo it from A, which is not F_s)."""
    for inc in problem.incidences(space):
        for f in inc.segment.factors[: inc.position]:
            if not problem.spaces[f.space].group.is_orthogonal(f.path):
                return inc.param
    return None


def space_bounds(problem: Problem, searched: Problem, canonical_a: Mapping[str, torch.Tensor],
                 canonical_b: Mapping[str, torch.Tensor], elements: Mapping[str, Element]) -> list[SpaceBound]:
    """One :class:`SpaceBound` per searched, non-trivial, active space (see the module)."""
    ctx = SolveContext(dtype=torch.float64)
    eps = element_eps(elements)
    elems = {s: problem.spaces[s].group.to(e, dtype=torch.float64) for s, e in elements.items()}
    a64 = {p: canonical_a[p].double() for p in problem.params}
    b64 = {p: canonical_b[p].double() for p in problem.params}
    stats = WeightStatistics(problem, a64, b64, ctx, init=elems)
    quad = quadratic_params(problem)
    out: list[SpaceBound] = []
    for s, si in problem.spaces.items():
        group = searched.spaces[s].group
        if group.is_trivial() or (not stats.active(s) and s not in quad):
            continue
        t0 = time.perf_counter()
        name = str(group)
        blocker = _after_non_orthogonal(problem, s)
        if blocker is not None:
            out.append(SpaceBound(s, name, "not available",
                                  f"a non-orthogonal map acts after it on {blocker}: its terms are not the objective"))
            continue
        if s in quad:
            sb = _quadratic_space(problem, s, group, _viewed(problem, a64), _viewed(problem, b64), elems, quad[s], ctx)
        else:
            terms = stats.terms(s)
            value = max(float(objective(si.group, terms, elems[s])), 0.0)
            why = missing_entry(BOUNDS, group, "per-space bound")
            if why is not None:
                sb = SpaceBound(s, name, "not available", why)
            else:
                bound, kind, method = BOUNDS[group.kind](group, terms, ctx)
                sb = SpaceBound(s, name, kind, method, value, bound, _noise(terms, eps))
        out.append(attrs.evolve(sb, seconds=time.perf_counter() - t0))
    return out


def _noise(terms: list[Term], eps: float = _EPS) -> float:
    """The rounding level of a value from these statistics: they cancel from about
    ||a||^2 + ||b||^2 down, with products of width n, at the elements' precision ``eps``
    (a float32 element acts exactly as itself, but is orthogonal only to float32)."""
    scale = sum(float(t.a_sq().sum()) + float(t.gram_diag().sum()) for t in terms)
    n = max((t.cross().shape[-1] for t in terms), default=1)
    return 16 * math.sqrt(n) * eps * scale


#: (group, the space's terms, ctx) -> (bound, kind: exact | relaxation, method), for a space
#: whose terms are linear in its action
BoundFn = Callable[[Group, list[Term], SolveContext], tuple[float, str, str]]


def _solved(method: str) -> BoundFn:
    """Exact: the kind's own solver minimises a linear space's terms (where it refuses
    them, e.g. abs terms under O: least squares)."""
    def bound(group: Group, terms: list[Term], ctx: SolveContext) -> tuple[float, str, str]:
        try:
            e = solver_for(group).solve(group, terms, group.identity(dtype=torch.float64), ctx)
        except SolverError:
            return _least_squares(group, terms, ctx)
        return max(float(objective(group, terms, e)), 0.0), "exact", method

    return bound


def _least_squares(group: Group, terms: list[Term], ctx: SolveContext) -> tuple[float, str, str]:
    return _lstsq_bound(terms), "relaxation", "least squares per term over all matrices"


def _diagonal(group: Group, terms: list[Term], ctx: SolveContext) -> tuple[float, str, str]:
    assert isinstance(group, DiagonalGroup)
    return _diagonal_bound(group, terms), "exact", "per unit: the roots of a quartic"


def _heads(group: Group, terms: list[Term], ctx: SolveContext) -> tuple[float, str, str]:
    assert isinstance(group, Heads)
    return _heads_bound(group, terms)


# -- least squares -----------------------------------------------------------------------------

def _fit(c: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """tr(C G^+ C^T) per batch entry: the best least-squares fit of a by X b over all X
    (float64; eigenvalues of G below its rounding dropped)."""
    c, g = c.double(), g.double()
    e, v = torch.linalg.eigh(0.5 * (g + g.mT))
    tol = e.abs().amax(-1, keepdim=True) * g.shape[-1] * 8 * _EPS
    inv = torch.where(e > tol, 1.0 / torch.where(e > tol, e, 1.0), 0.0)
    cv = c @ v
    return (cv.square() * inv.unsqueeze(-2)).sum((-1, -2))


def _lstsq_bound(terms: list[Term]) -> float:
    """sum over terms of min over all matrices X of ||a - X b||^2 (each term its own X)."""
    total = 0.0
    for t in terms:
        total += max(float(t.a_sq().double().sum()) - float(_fit(t.cross(), t.gram()).sum()), 0.0)
    return total


# -- diagonal scalings -------------------------------------------------------------------------

def _diagonal_bound(group: DiagonalGroup, terms: list[Term]) -> float:
    """min over d (d != 0, d > 0 for Dpos) of the terms, exactly per unit (module)."""
    n = group.n
    z = torch.zeros(n, dtype=torch.float64)
    k0 = 0.0
    c = {v: z.clone() for v in ("co", "contra", "abs")}
    g = {v: z.clone() for v in ("co", "contra", "abs")}
    for t in terms:
        k0 += float(t.a_sq().double().sum())
        c[t.variance] += torch.diagonal(t.cross().double())
        g[t.variance] += t.gram_diag().double()
    total = k0
    signs = (1.0,) if group.positive_only else (1.0, -1.0)
    for i in range(n):
        g2 = float(g["co"][i] + g["abs"][i])
        gc = float(g["contra"][i])
        cc = float(c["contra"][i])
        total += min(_unit_min(float(c["co"][i] + sigma * c["abs"][i]), g2, cc, gc, sigma) for sigma in signs)
    return max(total, 0.0)


def _unit_min(c1: float, g2: float, cc: float, gc: float, sigma: float) -> float:
    """inf over sigma * d > 0 of -2 c1 d + g2 d^2 - 2 cc / d + gc / d^2 (g2, gc >= 0; a zero
    Gram means zero data, so its cross term is zero too)."""
    if gc <= 0:  # a quadratic in d; its infimum at d -> 0 (value 0) when its vertex is across
        return -c1 * c1 / g2 if g2 > 0 and c1 * sigma > 0 else 0.0
    if g2 <= 0:  # a quadratic in 1/d
        return -cc * cc / gc if cc * sigma > 0 else 0.0
    best = math.inf
    # both sides: +inf at 0 and at infinity, so the minimum is at a stationary point
    for r in np.roots([g2, -c1, 0.0, cc, -gc]):
        if abs(r.imag) <= 1e-7 * max(1.0, abs(r.real)):
            d = _newton(float(r.real), c1, g2, cc, gc)
            if d * sigma > 0:
                best = min(best, -2 * c1 * d + g2 * d * d - 2 * cc / d + gc / (d * d))
    if math.isinf(best):  # no root found to rounding: each side fitted on its own (a lower bound)
        best = -(c1 * c1 / g2 if c1 * sigma > 0 else 0.0) - (cc * cc / gc if cc * sigma > 0 else 0.0)
    return best


def _newton(d: float, c1: float, g2: float, cc: float, gc: float) -> float:
    """A few Newton steps on the stationarity condition (polishes a companion-matrix root)."""
    for _ in range(4):
        p = g2 * d**4 - c1 * d**3 + cc * d - gc
        dp = 4 * g2 * d**3 - 3 * c1 * d**2 + cc
        if dp == 0:
            break
        step = p / dp
        if not math.isfinite(step):
            break
        d -= step
    return d


# -- head groups -------------------------------------------------------------------------------

def _heads_bound(group: Heads, terms: list[Term]) -> tuple[float, str, str]:
    """The head assignment on per-pair costs (module): exact for trivial parts, for
    permutations inside (an expert's units: an assignment per pair) and for O parts
    without grouped-query sharing; other orthogonal parts by the nuclear norm (a
    relaxation), least squares per piece otherwise."""
    h, k, gs = group.heads, group.kv, group.group_size
    lq = torch.zeros(h, h, dtype=torch.float64)
    lkv = torch.zeros(k, k, dtype=torch.float64)
    exact = True
    methods = set()
    for name, pts in part_terms(group, terms).items():
        if not pts:
            continue
        within = group.part(name)
        dh = within.n
        merge = within.is_trivial() or (within.is_orthogonal() and gs == 1)
        if within.is_orthogonal() and not merge:
            exact = False
        if merge:
            views = [[t for t, _ in pts]] if gs == 1 else [[t for t, kv in pts if not kv], [t for t, kv in pts if kv]]
            for i, ts in enumerate(views):
                if not ts:
                    continue
                kv_view = gs > 1 and i == 1
                nh = k if kv_view else h
                c = sum(head_blocks(t.cross().double(), nh, dh) for t in ts)
                a_sq = sum(t.rows_sq().double().reshape(nh, dh).sum(-1) for t in ts)
                b_sq = sum(t.gram_diag().double().reshape(nh, dh).sum(-1) for t in ts)
                if within.is_trivial():
                    fit = torch.diagonal(c, dim1=-2, dim2=-1).sum(-1)
                    methods.add("trace per head pair")
                elif within.kind == "S":  # permutations inside (an expert's units): the assignment per pair
                    inner = assign(c)
                    fit = torch.gather(c, -1, inner.unsqueeze(-1)).squeeze(-1).sum(-1)
                    methods.add("assignment per head pair")
                else:
                    fit = torch.linalg.matrix_norm(c, ord="nuc")
                    methods.add("nuclear norm per head pair")
                    if within.kind != "O":  # the best orthogonal map bounds a smaller group's best from above
                        exact = False
                cost = a_sq[:, None] + b_sq[None, :] - 2 * fit
                if kv_view:
                    lkv += cost
                else:
                    lq += cost
            continue
        exact = False
        methods.add("least squares per head pair and side")
        for t, kv_view in pts:
            nh = k if kv_view else h
            c = head_blocks(t.cross().double(), nh, dh)  # [new, old, dh, dh]
            g = t.gram_blocks(dh).double()  # [old, dh, dh]
            a_sq = t.rows_sq().double().reshape(nh, dh).sum(-1)
            fit = _fit(c, g[None].expand(nh, *g.shape))
            cost = (a_sq[:, None] - fit).clamp_min(0.0)
            if kv_view:
                lkv += cost
            else:
                lq += cost
    perm, qperm = assign_heads(group, -lq, -lkv)
    total = float(lkv[torch.arange(k), perm].sum())
    src = perm[:, None] * gs + qperm
    dst = torch.arange(k)[:, None] * gs + torch.arange(gs)
    total += float(lq[dst, src].sum())
    return max(total, 0.0), "exact" if exact else "relaxation", ", ".join(sorted(methods)) + "; head assignment"


#: group kind -> the per-space bound of a space whose terms are linear in its action (see the module)
BOUNDS: dict[str, BoundFn | NoEntry] = {
    "S": _solved("linear assignment"),
    "SP": _solved("signed assignment"),
    "Sign": _solved("sign of the trace"),
    "O": _solved("Procrustes (SVD)"),
    "OC": _solved("Procrustes in the zero-mean subspace"),
    "D": _diagonal,
    "Dpos": _diagonal,
    "Heads": _heads,
    "Experts": _heads,
    "GL": _least_squares,
    "RoPE": _least_squares,
    "Id": NoEntry("the trivial group is never searched: there is nothing to bound"),
}


# -- a space on two axes of a parameter ----------------------------------------------------------

def _quadratic_space(problem: Problem, s: str, group: Group, a64: Mapping[str, torch.Tensor],
                     b64: Mapping[str, torch.Tensor], elems: Mapping[str, Element], params: list[str],
                     ctx: SolveContext) -> SpaceBound:
    """F_s when s acts on two axes of some parameters: K - 2<C, M> + sum_r ||A_r M - M B_r||^2
    for orthogonal M (module)."""
    name = str(group)
    spec_group = problem.spaces[s].group
    if not group.is_orthogonal() or not spec_group.is_orthogonal():
        return SpaceBound(s, name, "not available", f"acts on two axes of {params[0]} with a non-orthogonal group")
    n = spec_group.n
    rest = attrs.evolve(problem, params={p: b for p, b in problem.params.items() if p not in params},
                        ties=tuple(t for t in problem.ties if not set(t) & set(params)))
    lin = WeightStatistics(rest, a64, b64, ctx, init=elems) if rest.params else None
    terms = lin.terms(s) if lin is not None and lin.active(s) else []
    k_const = sum(float(t.a_sq().double().sum()) + float(t.gram_diag().double().sum()) for t in terms)
    cross = sum((t.cross().double() for t in terms), torch.zeros(n, n, dtype=torch.float64))
    quads: list[tuple[torch.Tensor, torch.Tensor]] = []
    others = {x: e for x, e in elems.items()}
    others[s] = spec_group.identity(dtype=torch.float64)
    for p in params:
        got = _split_quadratic(problem, p, s, a64[p], transform(problem, p, b64[p], others))
        if got is None:
            return SpaceBound(s, name, "not available", f"acts on {p} in a way the bound does not model "
                                                        "(a product of factors, or several segments on one axis)")
        kq, cq, aq, bq = got
        k_const += kq
        cross = cross + cq
        quads.append((aq, bq))
    m_cur = spec_group.matrix(elems[s]).double()

    def value(m: torch.Tensor) -> float:
        v = k_const - 2 * float((cross * m).sum())
        for aq, bq in quads:
            v += float((aq @ m - m @ bq).square().sum())
        return v

    cur = max(value(m_cur), 0.0)
    scale = k_const + sum(float(aq.square().sum() + bq.square().sum()) for aq, bq in quads)
    noise = 16 * math.sqrt(n) * element_eps(elems) * scale
    missing = ""
    if isinstance(group, S) and n <= DS_LIMIT:
        try:
            bound = _birkhoff_bound(k_const, cross, quads)
            return SpaceBound(s, name, "relaxation", "doubly stochastic relaxation (cvxpy), Frank-Wolfe certified",
                              cur, max(bound, 0.0), noise)
        except ImportError:  # the looser decoupled bound below; the certificate lists this one
            missing = "the doubly stochastic relaxation"
    # decoupled: the linear part's exact maximum, von Neumann for each quadratic block
    if isinstance(group, S):
        perm = assign(cross)
        lin_max = float(cross[torch.arange(n), perm].sum())
    else:
        lin_max = float(torch.linalg.matrix_norm(cross, ord="nuc"))
    bound = k_const - 2 * lin_max
    for aq, bq in quads:
        sa, sb = torch.linalg.svdvals(aq), torch.linalg.svdvals(bq)
        bound += float(aq.square().sum() + bq.square().sum()) - 2 * float((sa * sb).sum())
    how = "decoupled: linear part exact, von Neumann for the quadratic part"
    return SpaceBound(s, name, "relaxation", how + (f" ({missing}: {NEEDS_CVXPY})" if missing else ""),
                      cur, max(bound, 0.0), noise, needs_cvxpy=missing)


def _split_quadratic(problem: Problem, p: str, s: str, a: torch.Tensor,
                     x: torch.Tensor) -> tuple[float, torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """(constant, cross-covariance, A-blocks, B-blocks) of parameter ``p`` as a function of
    s's orthogonal action M (every other space applied to ``x``): ``||A - M.x||^2 =
    const - 2<C, M> + sum_r ||A_r M - M B_r||^2``, the blocks stacked over r."""
    pb = problem.params[p]
    where = []
    for ab in pb.axes:
        segs = [seg for seg in ab.segments if any(f.space == s for f in seg.factors)]
        if not segs:
            continue
        if len(segs) > 1 or len(segs[0].factors) > 1:
            return None
        where.append((ab, segs[0]))
    if len(where) != 2:
        return None
    (ab_i, si), (ab_j, sj) = where

    def concat(t: torch.Tensor) -> torch.Tensor:
        for ab in (ab_i, ab_j):
            if ab.layout is not None:
                t = ab.layout.to_concat(t.movedim(ab.axis, 0)).movedim(0, ab.axis)
        rest = [d for d in range(t.ndim) if d not in (ab_i.axis, ab_j.axis)]
        t = t.permute(ab_i.axis, ab_j.axis, *rest)
        return t.reshape(t.shape[0], t.shape[1], -1)

    a3, x3 = concat(a), concat(x)
    ri = torch.zeros(a3.shape[0], dtype=torch.bool)
    ri[si.start : si.stop] = True
    rj = torch.zeros(a3.shape[1], dtype=torch.bool)
    rj[sj.start : sj.stop] = True
    aq = a3[ri][:, rj].permute(2, 0, 1)  # [r, n, n]
    bq = x3[ri][:, rj].permute(2, 0, 1)
    a1, x1 = a3[ri][:, ~rj].reshape(si.size, -1), x3[ri][:, ~rj].reshape(si.size, -1)  # M on rows
    a2 = a3[~ri][:, rj].permute(1, 0, 2).reshape(sj.size, -1)  # M on columns, moved to rows
    x2 = x3[~ri][:, rj].permute(1, 0, 2).reshape(sj.size, -1)
    const = float(a1.square().sum() + x1.square().sum() + a2.square().sum() + x2.square().sum())
    return const, a1 @ x1.T + a2 @ x2.T, aq, bq


def _birkhoff_bound(k_const: float, cross: torch.Tensor, quads: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    """min over doubly stochastic X of K - 2<C, X> + sum_r ||A_r X - X B_r||^2, solved
    with cvxpy and certified by the Frank-Wolfe bound at the solution (module)."""
    import cvxpy as cp  # optional: the convex extra

    n = cross.shape[0]
    c = cross.numpy()
    x = cp.Variable((n, n), nonneg=True)
    obj: Any = k_const - 2 * cp.sum(cp.multiply(c, x))
    for aq, bq in quads:
        for r in range(aq.shape[0]):
            obj = obj + cp.sum_squares(aq[r].numpy() @ x - x @ bq[r].numpy())
    prob = cp.Problem(cp.Minimize(obj), [cp.sum(x, axis=0) == 1, cp.sum(x, axis=1) == 1])
    try:  # no PSD cone (n <= DS_LIMIT): Clarabel's KKT system is small
        prob.solve(solver=cp.CLARABEL)
    except cp.error.SolverError:
        # Ctrl-C inside SCS is KeyboardInterrupt, not a failure; after a failure the
        # Frank-Wolfe bound holds at any X: at the centre below
        with contextlib.suppress(cp.error.SolverError):
            solve(prob, cp.SCS)
    xs = torch.as_tensor(x.value if x.value is not None else np.full((n, n), 1.0 / n), dtype=torch.float64)
    return _frank_wolfe_bound(k_const, cross, quads, xs)


def _frank_wolfe_bound(k_const: float, cross: torch.Tensor, quads: list[tuple[torch.Tensor, torch.Tensor]],
                       x: torch.Tensor) -> float:
    """f(X) + min over permutations Y of <grad f(X), Y - X>: a lower bound on min_DS f for
    any X (f convex), whatever the solver returned."""
    f = k_const - 2 * float((cross * x).sum())
    grad = -2 * cross.clone()
    for aq, bq in quads:
        for r in range(aq.shape[0]):
            res = aq[r] @ x - x @ bq[r]
            f += float(res.square().sum())
            grad += 2 * (aq[r].T @ res - res @ bq[r].T)
    perm = assign(-grad)  # the permutation minimising <grad, Y>
    lin = float(grad[torch.arange(x.shape[0]), perm].sum()) - float((grad * x).sum())
    return f + lin


def _viewed(problem: Problem, sd: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Bound tensors as their axes see them (a ``view:`` merges stored axes)."""
    return {p: problem.params[p].viewed(t) for p, t in sd.items()}
