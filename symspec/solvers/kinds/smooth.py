"""Non-compact groups: GL(n), diagonal scalings D(n)/Dpos(n) and the RoPE commutant.

A map X that acts as X on some terms (``co``) and as X^-T on others (``contra``; the
dual side of a QK pairing, the input axis of the next layer) gives the objective

    f(X) = sum_co w||a - X b||^2 + sum_contra w||a - X^-T b||^2,

with no closed form when both kinds are present. Each solver starts from the best of
closed-form candidates (the co side alone: X = C G^-1; the contra side alone:
X^-T = C G^-1; the equation-error solution of a Sylvester equation; the identity; the
current element) and then

- GL: runs a batched Gauss-Newton iteration on the group (each step solves a Sylvester
  equation exactly) with a backtracking (Armijo) line search on the exact objective;
  steps that lose invertibility have an infinite objective and are rejected, so the
  iteration is monotone and stays in the group;
- D, Dpos: minimise each coordinate exactly (the stationary points of a quartic);
- RoPE: minimise each frequency pair's complex scalar exactly over its phase, and over
  its modulus by a grid and a golden-section search; the unrotated dims are a GL block.

All of it runs on the n x n statistics (never on the weights), in float64.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import attrs
import torch

from ...groups import Element, Group, RoPE
from ...linalg import lu_inv_ex, lu_solve
from ..engine.base import SolveContext, SolverError, Term, require_variances, solver
from .scale_value import SCALE_NEWTON_STEPS, ScaleWork, best_scale_value, scale_value_bound  # noqa: F401  (re-exported: the pair score looks it up here)

Stats = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # cross, gram, a_sq


def _stats(terms: list[Term], variance: str, n: int) -> Stats | None:
    """The summed statistics of the terms of one variance, batch flattened, in float64."""
    sel = [t for t in terms if t.variance == variance]
    if not sel:
        return None
    c = sum(t.cross().to(torch.float64) for t in sel)
    g = sum(t.gram().to(torch.float64) for t in sel)
    a = sum(t.a_sq().to(torch.float64) for t in sel)
    return (c.reshape(-1, n, n), g.reshape(-1, n, n), a.reshape(-1))  # type: ignore[union-attr]


def _ls(s: Stats, toward: torch.Tensor | None = None) -> torch.Tensor:
    """The least-squares X for ||a - X b||: X = C G^-1, lightly regularised towards
    ``toward`` (default 0): X = (C + lam T)(G + lam I)^-1. Where the data do not reach
    (G rank-deficient: few terms, a bias) the minimiser is not unique, and X keeps
    ``toward`` there instead of collapsing to a singular matrix that no GL element is."""
    c, g, _ = s
    n = g.shape[-1]
    lam = (torch.diagonal(g, dim1=-2, dim2=-1).sum(-1) / n).clamp_min(1e-300) * 1e-12
    eye = torch.eye(n, dtype=g.dtype, device=g.device)
    rhs = c if toward is None else c + lam[:, None, None] * toward
    return lu_solve(g + lam[:, None, None] * eye, rhs.mT).mT


# ---------------------------------------------------------------------------------------
# the GL objective, batched over independent problems


FunGrad = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


# ---------------------------------------------------------------------------------------
# GL(n)


def _gl_fun_grad(co: Stats | None, ct: Stats | None) -> FunGrad:
    """f(X) = sum_co ||a - X b||^2 + sum_contra ||a - X^-T b||^2 and its gradient [B, n, n],
    from the statistics: with Y = X^-T and R = 2 (Y G - C), d/dX of the contra part is
    -(X^-1 R X^-1)^T. A singular X has f = inf."""

    def fg(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        f, grad, _ = _gl_eval(co, ct, x)
        assert grad is not None
        return f, grad

    return fg


@attrs.frozen
class _Products:
    """What an evaluation at X computed that a Gauss-Newton step reuses."""

    inv: torch.Tensor | None  # X^-1 (contra terms)
    xg: torch.Tensor | None  # X G_co
    yg: torch.Tensor | None  # X^-T G_contra
    #: the size of the terms that cancel in f (||a||^2 + 2|<X, C>| + <X G, X>): f's
    #: rounding error is eps64 of it
    scale: torch.Tensor


def _gl_eval(co: Stats | None, ct: Stats | None, x: torch.Tensor,
             grad: bool = True) -> tuple[torch.Tensor, torch.Tensor | None, _Products]:
    """f(X), its gradient (when ``grad``) and the products behind them."""
    total = torch.zeros(x.shape[0], dtype=x.dtype, device=x.device)
    scale = torch.zeros_like(total)
    g_out = torch.zeros_like(x) if grad else None
    inv = xg = yg = None
    if co is not None:
        c, g, a = co
        xg = x @ g
        quad, lin = (xg * x).sum((-1, -2)), (c * x).sum((-1, -2))
        total = total + a + quad - 2 * lin
        scale = scale + a + quad.abs() + 2 * lin.abs()
        if g_out is not None:
            g_out = g_out + 2 * (xg - c)
    if ct is not None:
        c, g, a = ct
        inv, info = lu_inv_ex(x)
        y = inv.mT
        yg = y @ g
        quad, lin = (yg * y).sum((-1, -2)), (c * y).sum((-1, -2))
        total = torch.where(info == 0, total + a + quad - 2 * lin, torch.inf)
        scale = scale + a + quad.abs() + 2 * lin.abs()
        if g_out is not None:
            g_out = g_out - (inv @ (2 * (yg - c)) @ inv).mT
    return total, g_out, _Products(inv, xg, yg, scale)


#: a Gauss-Newton problem stops once a step gains no more than this many eps of the
#: size of the terms that cancel in f (f is accurate to about that, computed in float64)
GN_ROUNDING = 16.0


def gauss_newton_gl(co: Stats, ct: Stats, x0: torch.Tensor, *, max_iter: int = 10,
                    rtol: float = 1e-10) -> tuple[torch.Tensor, torch.Tensor]:
    """Minimise f(X) (co and contra terms) for B independent X [B, n, n] from ``x0``.

    Gauss-Newton on the group: the step is X <- (I + tE) X, where E minimises the
    linearised residuals ``||r_co - E X b||^2 + ||r_contra + E^T X^-T b||^2``. Its normal
    equations are the Sylvester equation ``M E + E S = -grad_E / 2`` with
    ``M = Y G_contra Y^T``, ``S = X G_co X^T`` (Y = X^-T), solved exactly by two symmetric
    eigendecompositions. A backtracking (Armijo) line search on the exact objective makes
    every step decrease f; singular trial points have f = inf and are rejected, so X stays
    invertible. A problem stops when a step gains less than ``rtol`` (relative); a step
    that gains no more than f's rounding error (``GN_ROUNDING`` eps of the terms that
    cancel in it) is not taken, and stops it too.
    The inverse and the products with the Grams of the accepted point are reused by the
    next step.
    """
    x = x0.clone()
    f, grad, pr = _gl_eval(co, ct, x)
    assert grad is not None and pr.inv is not None and pr.xg is not None and pr.yg is not None
    inv, xg, yg, scale = pr.inv, pr.xg, pr.yg, pr.scale
    eps = torch.finfo(x.dtype).eps
    active = torch.isfinite(f)
    eye = torch.eye(x.shape[-1], dtype=x.dtype, device=x.device)
    tiny = torch.finfo(x.dtype).tiny
    for _ in range(max_iter):
        if not bool(active.any()):
            break
        lam, u = torch.linalg.eigh(yg @ inv)  # Y G_ct Y^T
        sig, v = torch.linalg.eigh(xg @ x.mT)  # X G_co X^T
        g_e = grad @ x.mT
        den = (lam[:, :, None] + sig[:, None, :]).clamp_min(0)
        den = den + 1e-12 * den.amax((-1, -2), keepdim=True).clamp_min(tiny)
        e = -u @ ((u.mT @ g_e @ v) / (2 * den)) @ v.mT
        gd = (g_e * e).sum((-1, -2))
        t = torch.ones_like(f)
        pending = active & (gd < 0)
        x_new, f_new, g_new = x.clone(), f.clone(), grad.clone()
        inv_new, xg_new, yg_new, scale_new = inv.clone(), xg.clone(), yg.clone(), scale.clone()
        for _ in range(40):
            trial = (eye + t[:, None, None] * e) @ x
            ft, gt, pt = _gl_eval(co, ct, trial)
            assert gt is not None and pt.inv is not None and pt.xg is not None and pt.yg is not None
            ok = pending & torch.isfinite(ft) & (ft <= f + 1e-4 * t * gd)
            x_new[ok], f_new[ok], g_new[ok] = trial[ok], ft[ok], gt[ok]
            inv_new[ok], xg_new[ok], yg_new[ok], scale_new[ok] = pt.inv[ok], pt.xg[ok], pt.yg[ok], pt.scale[ok]
            pending &= ~ok
            if not bool(pending.any()):
                break
            t = torch.where(pending, t * 0.5, t)
        decrease = f - f_new
        # a step that gains no more than f's rounding error is not taken: its direction
        # and its gain are noise
        moved = active & (decrease > GN_ROUNDING * eps * (scale + scale_new))
        m = moved[:, None, None]
        x, grad, inv, xg, yg = (torch.where(m, new, old) for new, old in
                                ((x_new, x), (g_new, grad), (inv_new, inv), (xg_new, xg), (yg_new, yg)))
        f, scale = torch.where(moved, f_new, f), torch.where(moved, scale_new, scale)
        active = moved & (decrease > rtol * f.abs().clamp_min(tiny))
    return x, f


def equation_error(co: Stats, ct: Stats, h_ct: torch.Tensor) -> torch.Tensor:
    """The X minimising ``||X b_co - a_co||^2 + ||X^T a_ct - b_ct||^2``: the contra side's
    error measured before inversion, which makes the problem linear. Its normal equations
    are the Sylvester equation ``H X + X G = C_co + C_ct`` (H: A's Gram of the contra
    terms, G: B's Gram of the co terms), solved by two eigendecompositions. Exact on
    planted pairs; a start that avoids the poor local minima of the exact objective."""
    lam, u = torch.linalg.eigh(h_ct)
    sig, v = torch.linalg.eigh(co[1])
    den = lam[:, :, None] + sig[:, None, :]
    den = den + 1e-12 * den.amax((-1, -2), keepdim=True).clamp_min(torch.finfo(den.dtype).tiny)
    return u @ ((u.mT @ (co[0] + ct[0]) @ v) / den) @ v.mT


#: bytes of one [B, n, n] temporary of a batched GL solve: larger batches are solved in
#: chunks. Dozens of temporaries per Gauss-Newton step: kept small they are reused from
#: the heap and stay in cache; 144 heads of 64 in one batch (4.7 MB each) are fresh
#: mappings, page-faulted in, every op, wherever glibc's mmap threshold is low (as
#: ``symspec match`` sets it to keep the peak memory down)
GL_CHUNK_BYTES = 1 << 19


def minimize_gl(co: Stats | None, ct: Stats | None, current: torch.Tensor, ctx: SolveContext,
                h_ct: torch.Tensor | None = None) -> torch.Tensor:
    """The best X [B, n, n] for co terms (X) and contra terms (X^-T), from ``current``
    (``h_ct``: A's Gram of the contra terms, for the equation-error start), solved in
    chunks of the batch (``GL_CHUNK_BYTES``); the problems are independent."""
    n = current.shape[-1]
    step = max(1, GL_CHUNK_BYTES // (n * n * current.element_size()))
    if current.shape[0] <= step:
        return _minimize_gl(co, ct, current, ctx, h_ct)

    def part(s: Stats | None, sl: slice) -> Stats | None:
        return None if s is None else (s[0][sl], s[1][sl], s[2][sl])

    out = []
    for i in range(0, current.shape[0], step):
        sl = slice(i, i + step)
        out.append(_minimize_gl(part(co, sl), part(ct, sl), current[sl], ctx, None if h_ct is None else h_ct[sl]))
    return torch.cat(out)


def _minimize_gl(co: Stats | None, ct: Stats | None, current: torch.Tensor, ctx: SolveContext,
                 h_ct: torch.Tensor | None = None) -> torch.Tensor:
    n = current.shape[-1]
    eye = torch.eye(n, dtype=current.dtype, device=current.device).expand_as(current)
    cands = [current, eye]
    if co is not None:
        cands.append(_ls(co, current))
    if ct is not None:  # the contra terms' least squares is for X^-T: regularise towards current^-T
        cur_inv, ok = lu_inv_ex(current)
        toward = torch.where((ok == 0)[:, None, None], cur_inv.mT, eye)
        inv, info = lu_inv_ex(_ls(ct, toward))
        cands.append(torch.where((info == 0)[:, None, None], inv.mT, eye))
    if co is not None and ct is not None and h_ct is not None:
        cands.append(equation_error(co, ct, h_ct))
    vals = torch.stack([_gl_eval(co, ct, c, grad=False)[0] for c in cands])  # [K, B]
    vals = torch.where(torch.isfinite(vals), vals, torch.inf)
    best = vals.argmin(0)
    x0 = torch.stack(cands)[best, torch.arange(current.shape[0], device=current.device)]
    if co is None or ct is None:
        return x0  # one-sided: least squares is the minimiser
    with ctx.timer("iterate"):
        x, _ = gauss_newton_gl(co, ct, x0, max_iter=ctx.max_iter, rtol=ctx.rtol)
    # a problem where Gauss-Newton broke down (non-finite) keeps its best starting point
    return torch.where(torch.isfinite(x).all(-1, keepdim=True).all(-2, keepdim=True), x, x0)


@solver("GL", cheap_apply=False, batched=True)
def solve_gl(group: Group, terms: list[Term], current: Element, ctx: SolveContext) -> Element:
    require_variances(group, terms, {"co", "contra"})
    m = current["matrix"]
    n = group.n
    co = _stats(terms, "co", n)
    ct = _stats(terms, "contra", n)
    if co is None and ct is None:
        return current
    x = minimize_gl(co, ct, m.to(torch.float64).reshape(-1, n, n), ctx, _gram_a(terms, "contra", n) if co and ct else None)
    return {"matrix": x.reshape(m.shape).to(m.dtype)}


def _gram_a(terms: list[Term], variance: str, n: int) -> torch.Tensor | None:
    """A's Gram of the terms of one variance, [B, n, n], or None where a term lacks it."""
    try:
        return sum(t.gram_a().to(torch.float64) for t in terms if t.variance == variance).reshape(-1, n, n)  # type: ignore[union-attr]
    except SolverError:
        return None


# ---------------------------------------------------------------------------------------
# D(n), Dpos(n): per coordinate, exactly


def _diag(terms: list[Term], variance: str, batch_n: tuple[int, int], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The diagonals of the summed cross and Gram matrices of one variance's terms, in
    float64 (never the n x n matrices: a scaling's problem is per coordinate)."""
    sel = [t for t in terms if t.variance == variance]
    if not sel:
        z = torch.zeros(batch_n, dtype=torch.float64, device=device)
        return z, z
    c = sum(t.cross_diag().to(torch.float64) for t in sel)
    g = sum(t.gram_diag().to(torch.float64) for t in sel)
    return c.reshape(batch_n), g.reshape(batch_n)  # type: ignore[union-attr]


def _diag_value(d: torch.Tensor, p: dict[str, torch.Tensor]) -> torch.Tensor:
    """f(d) - const for candidates d [..., K] (coefficients broadcast on the last dim)."""
    inv = 1.0 / torch.where(d == 0, 1.0, d)
    val = (p["g_co"] + p["g_ab"]) * d**2 - 2 * p["c_co"] * d - 2 * p["c_ab"] * d.abs()
    val = val + p["g_ct"] * inv**2 - 2 * p["c_ct"] * inv
    return torch.where(torch.isfinite(val) & (d != 0), val, torch.inf)


def _quartic_real_parts(c4: torch.Tensor, c3: torch.Tensor, c1: torch.Tensor, c0: torch.Tensor) -> torch.Tensor:
    """Real parts of the roots of c4 x^4 + c3 x^3 + c1 x + c0 (c4 > 0), [..., 4]."""
    safe = torch.where(c4 > 0, c4, 1.0)
    comp = torch.zeros(*c4.shape, 4, 4, dtype=torch.float64, device=c4.device)
    comp[..., 0, 0] = -c3 / safe
    comp[..., 0, 2] = -c1 / safe
    comp[..., 0, 3] = -c0 / safe
    comp[..., 1, 0] = 1
    comp[..., 2, 1] = 1
    comp[..., 3, 2] = 1
    roots = torch.linalg.eigvals(comp).real
    return torch.where((c4 > 0)[..., None], roots, torch.nan)


def _polish(cand: torch.Tensor, coef: dict[str, torch.Tensor], steps: int = 3) -> torch.Tensor:
    """Newton steps on f' from every candidate scale (``_diag_value``'s f), each kept only
    where it lowers f and stays on its sign."""
    for _ in range(steps):
        d = cand
        inv = 1.0 / torch.where(d == 0, 1.0, d)
        sgn = torch.sign(d)
        f1 = 2 * (coef["g_co"] + coef["g_ab"]) * d - 2 * coef["c_co"] - 2 * coef["c_ab"] * sgn - 2 * coef["g_ct"] * inv**3 + 2 * coef["c_ct"] * inv**2
        f2 = 2 * (coef["g_co"] + coef["g_ab"]) + 6 * coef["g_ct"] * inv**4 - 4 * coef["c_ct"] * inv**3
        step = torch.where((f2 > 0) & (d != 0), f1 / torch.where(f2 > 0, f2, 1.0), 0.0)
        moved = d - step
        keep = (_diag_value(moved, coef) <= _diag_value(d, coef)) & (torch.sign(moved) == sgn)
        cand = torch.where(keep, moved, d)
    return cand


def exact_scale_value(coef: dict[str, torch.Tensor | float], positive: bool) -> torch.Tensor:
    """The true maximum over d of :func:`best_scale_value`'s value (no abs terms ``c_ab``;
    ``g_ab`` joins ``g_co``): every real root of the stationarity quartic
    ``g d^4 - c_co d^3 + c_ct d - g_ct = 0``, polished by Newton steps, the best taken.
    The oracle :func:`best_scale_value` is measured against (bench/bench_pair_score.py):
    a 4 x 4 eigenvalue problem per pair, which the assignment's score avoids."""
    ref = next(v for v in coef.values() if isinstance(v, torch.Tensor))
    c = {k: torch.as_tensor(v, dtype=torch.float64) for k, v in coef.items()}
    shape = torch.broadcast_shapes(*(v.shape for v in c.values()))
    c = {k: v.expand(shape) for k, v in c.items()}
    d = torch.nan_to_num(_quartic_real_parts(c["g_co"] + c["g_ab"], -c["c_co"], c["c_ct"], -c["g_ct"]), nan=1.0)
    if positive:
        d = torch.where(d > 0, d, 1e-300)
    cu = {k: v.unsqueeze(-1) for k, v in c.items()}
    best = (-_diag_value(_polish(d, cu), cu)).max(-1).values
    best = torch.where(best == -torch.inf, 0.0, best)
    return torch.where(c["g_ct"] == 0, best.clamp_min(0.0), best).to(ref.dtype)


def _solve_diagonal(group: Group, terms: list[Term], current: Element, ctx: SolveContext, positive: bool) -> Element:
    require_variances(group, terms, {"co", "contra", "abs"})
    d0 = current["diag"]
    shape = tuple(d0.shape)
    n = group.n
    flat = (int(torch.tensor(shape[:-1]).prod()) if len(shape) > 1 else 1, n)
    c_co, g_co = _diag(terms, "co", flat, d0.device)
    c_ct, g_ct = _diag(terms, "contra", flat, d0.device)
    c_ab, g_ab = _diag(terms, "abs", flat, d0.device)
    cur = d0.to(torch.float64).reshape(flat)
    cands = [cur]
    signs = (1.0,) if positive else (1.0, -1.0)
    for sigma in signs:
        a4 = g_co + g_ab
        b3 = c_co + sigma * c_ab
        # stationary points of f on the branch sign(d) = sigma: a4 d^4 - b3 d^3 + c_ct d - g_ct = 0
        cands.append(_quartic_real_parts(a4, -b3, c_ct, -g_ct))
        cands.append((b3 / a4).unsqueeze(-1))
        cands.append((g_ct / c_ct).unsqueeze(-1))
    cand = torch.cat([c if c.ndim == 3 else c.unsqueeze(-1) for c in cands], -1)  # [B, n, K]
    cand = torch.nan_to_num(cand, nan=0.0, posinf=0.0, neginf=0.0)
    if positive:
        cand = torch.where(cand > 0, cand, 0.0)
    coef = {k: v.unsqueeze(-1) for k, v in {"g_co": g_co, "c_co": c_co, "g_ct": g_ct, "c_ct": c_ct, "g_ab": g_ab, "c_ab": c_ab}.items()}
    # polish every candidate with Newton steps on f' (keeping those that do not improve)
    cand = _polish(cand, coef)
    vals = _diag_value(cand, coef)
    best = vals.argmin(-1, keepdim=True)
    d = torch.gather(cand, -1, best).squeeze(-1)
    # coordinates without any term keep their value
    free = (g_co + g_ct + g_ab) == 0
    d = torch.where(free, cur, d)
    return {"diag": d.reshape(shape).to(d0.dtype)}


@solver("D", cheap_apply=True, batched=True)
def solve_diagonal(group: Group, terms: list[Term], current: Element, ctx: SolveContext) -> Element:
    return _solve_diagonal(group, terms, current, ctx, positive=False)


@solver("Dpos", cheap_apply=True, batched=True)
def solve_positive_diagonal(group: Group, terms: list[Term], current: Element, ctx: SolveContext) -> Element:
    return _solve_diagonal(group, terms, current, ctx, positive=True)


# ---------------------------------------------------------------------------------------
# RoPE commutant


def _pair_stats(s: Stats | None, i1: torch.Tensor, i2: torch.Tensor, shape: tuple[int, int],
                device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Per pair: the complex correlation c = p + iq and g = tr(G_pair), so that
    ||a - z b||^2 = const - 2 Re(z conj(c)) + |z|^2 g for the pair block aI + bJ."""
    if s is None:
        z = torch.zeros(shape, dtype=torch.float64, device=device)
        return torch.complex(z, z), z
    c, g, _ = s
    c11, c22 = c[:, i1, i1], c[:, i2, i2]
    c12, c21 = c[:, i1, i2], c[:, i2, i1]
    return torch.complex(c11 + c22, c21 - c12), g[:, i1, i1] + g[:, i2, i2]


def _rope_pair_value(z: torch.Tensor, c: torch.Tensor, g: torch.Tensor, cc: torch.Tensor, gc: torch.Tensor) -> torch.Tensor:
    r2 = z.real**2 + z.imag**2
    val = g * r2 - 2 * (z * c.conj()).real
    u = z / r2
    val = val + gc * (u.real**2 + u.imag**2) - 2 * (u * cc.conj()).real
    return torch.where(torch.isfinite(val) & (r2 > 0), val, torch.inf)


@solver("RoPE", cheap_apply=True, batched=True)
def solve_rope(group: Group, terms: list[Term], current: Element, ctx: SolveContext) -> Element:
    assert isinstance(group, RoPE)
    require_variances(group, terms, {"co", "contra"})
    n, k = group.n, group.rot // 2
    co = _stats(terms, "co", n)
    ct = _stats(terms, "contra", n)
    if co is None and ct is None:
        return current
    out = dict(current)
    bsz = co[0].shape[0] if co is not None else ct[0].shape[0]  # type: ignore[index]
    if k:
        i1, i2 = (p.to(current["a"].device) for p in group.pairs)
        c, g = _pair_stats(co, i1, i2, (bsz, k), i1.device)
        cc, gc = _pair_stats(ct, i1, i2, (bsz, k), i1.device)
        a0 = current["a"].to(torch.float64).reshape(bsz, k)
        b0 = current["b"].to(torch.float64).reshape(bsz, k)
        z0 = torch.complex(a0, b0)
        # With z = r e^{i theta}: f = g r^2 + gc / r^2 - 2 Re(e^{i theta} conj(r c + cc / r)); the
        # best phase is arg(r c + cc / r), leaving h(r) = g r^2 + gc / r^2 - 2 |r c + cc / r|.
        def h(r: torch.Tensor) -> torch.Tensor:
            return g[..., None] * r**2 + gc[..., None] / r**2 - 2 * (r * c[..., None] + cc[..., None] / r).abs()

        r_co = torch.where(g > 0, c.abs() / torch.where(g > 0, g, 1.0), torch.nan)
        r_ct = torch.where(cc.abs() > 0, gc / torch.where(cc.abs() > 0, cc.abs(), 1.0), torch.nan)
        ref = torch.stack([r_co, r_ct, z0.abs()], -1)
        ref = torch.where(torch.isfinite(ref) & (ref > 0), ref, torch.nan)
        lo = torch.nan_to_num(ref.nan_to_num(nan=math.inf).amin(-1), posinf=1.0).clamp_min(1e-150) / 100
        hi = torch.nan_to_num(ref.nan_to_num(nan=0.0).amax(-1), nan=1.0).clamp_min(1e-150) * 100
        hi = torch.maximum(hi, lo * 1e4)
        grid = torch.linspace(0, 1, 65, dtype=torch.float64, device=g.device)
        logr = lo.log()[..., None] + (hi.log() - lo.log())[..., None] * grid
        vals = h(logr.exp())
        j = vals.argmin(-1, keepdim=True)
        step = (hi.log() - lo.log())[..., None] / 64
        left = torch.gather(logr, -1, j) - step
        right = torch.gather(logr, -1, j) + step
        phi = (math.sqrt(5) - 1) / 2
        for _ in range(60):
            m1 = right - phi * (right - left)
            m2 = left + phi * (right - left)
            better = h(m1.exp()) < h(m2.exp())
            right = torch.where(better, m2, right)
            left = torch.where(better, left, m1)
        r = ((left + right) / 2).exp().squeeze(-1)
        w = r * c + cc / r
        phase = torch.where(w.abs() > 0, w / torch.where(w.abs() > 0, w.abs(), 1.0), torch.ones_like(w))
        z = r * phase
        keep = _rope_pair_value(z0, c, g, cc, gc) <= _rope_pair_value(z, c, g, cc, gc)
        z = torch.where(keep, z0, z)
        out["a"] = z.real.reshape(current["a"].shape).to(current["a"].dtype)
        out["b"] = z.imag.reshape(current["b"].shape).to(current["b"].dtype)
    if group.rot < n:
        sl = slice(group.rot, n)

        def sub(s: Stats | None) -> Stats | None:
            return None if s is None else (s[0][:, sl, sl], s[1][:, sl, sl], s[2])

        rest = current["rest"]
        m = n - group.rot
        h_ct = _gram_a(terms, "contra", n) if co is not None and ct is not None else None
        x = minimize_gl(sub(co), sub(ct), rest.to(torch.float64).reshape(-1, m, m), ctx, None if h_ct is None else h_ct[:, sl, sl])
        out["rest"] = x.reshape(rest.shape).to(rest.dtype)
    return out
