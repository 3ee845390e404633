"""A joint lower bound over several spaces at once: a Shor-type semidefinite relaxation.

Take a set V of spaces whose searched groups act by orthogonal matrices that are affine
in a matrix variable M_s: permutations S(n) and head permutations with trivial parts
(M_s a permutation matrix; a head's action is ``M_s (x) I_dh``), O(n) (M_s orthogonal)
and OC(n) (``rho = B M_s B^T + 11^T/n`` with B an orthonormal basis of the zero-mean
subspace, M_s in O(n-1)). Every other space is fixed at the result's element. With
every variable orthogonal, ``||g.B_p|| = ||B_p'||`` (B_p' with the fixed spaces applied), so
on the feasible set

    F = K - 2 (k0 + c^T x + x^T W x),   x = (vec M_s)_{s in V},

where the inner products <A_p, g.B_p> of the parameters' blocks are linear (one variable
axis) or bilinear (two; the same variable twice: quadratic) in x. Lift
``Y = [1 x^T; x X] >= 0`` (X standing for x x^T) and keep constraints that every
feasible x satisfies: Y_00 = 1; for permutations the row and column sums (on x and,
multiplied by any other entry, on Y), x >= 0 and X >= 0 between permutation entries,
diag X = x, ``M^T M = M M^T = I`` on X; for orthogonal variables ``M^T M = M M^T = I``
on X. Then ``max <C~, Y>`` over the relaxation is at least the maximum over the group,
and ``K - 2 (k0 + max)`` is a lower bound on min F over V (others fixed); over every
searched space, on the global minimum.

The bound never rests on the solver's accuracy. Weak duality: for any multipliers y
(equalities ``A(Y) = b``) and z >= 0 (the nonnegative entries), with
``S = A*(y) - Sel*(z) - C~``, every feasible Y has
``<C~, Y> = b^T y - <Sel*(z), Y> - <S, Y> <= b^T y + max(0, -lambda_min(S)) tr Y``, and
``tr Y = 1 + sum_s n_s`` is fixed by the constraints. The solver's multipliers (z clipped
at 0) are put into this formula, in float64.

Spaces that do not interact are not lifted together. Two spaces interact when one
parameter carries them on two of its axes; a space on two axes of one parameter
interacts with itself (:func:`components`). The inner part is a sum over the groups of
interacting spaces, so its maximum is the sum of theirs: a space that interacts with
none is linear and is maximised exactly (an assignment for a permutation, the nuclear
norm for an orthogonal map: :func:`linear_max`), at any size; only a group that does
interact is lifted. With the residual fixed, the spaces of one layer (its heads, its
units) share no parameter, so the bound over a layer is exact whatever its widths.

Size: a lifted group has ``N + 1`` rows, ``N = sum_s dim(M_s)^2`` over its spaces; it is
solved when ``N <= JOINT_LIMIT``. The residual with a layer's units is far beyond it
(O(d) and S(f) interact on every matrix between them, N = d^2 + f^2), which is what the
second relaxation is for.

The Gram relaxation (:func:`gram_relaxation`), for a star: one hub M (m x m, orthogonal,
or a permutation relaxed to the orthogonal group plus its doubly stochastic
constraints) and leaves P_s (permutations, head permutations) that interact with the
hub alone, as the residual does with the heads and units of every layer. Its inner part
is ``<C, M> + sum_s (<L_s, P_s> + sum_K <F_K, M V_K>)``, ``V_K = sum_L P_KL G_L``: F_K
and G_L (m x q) are the vectors of A's unit K and B's unit L that meet the hub. The
Gram matrix of the columns of ``[I, M, M V]`` is

    Y = [[I, M, Z], [M^T, I, V], [Z^T, V^T, W]],   Z = M V, W = V^T V,

PSD, and linear in the unknowns except W. The relaxation keeps Y >= 0, both identity
blocks, V linear in P (P doubly stochastic, p >= 0), W's diagonal blocks
``W_KK = sum_L P_KL G_L^T G_L`` and block rows ``sum_K' W_KK' = sum_L P_KL G_L^T S``
(S = sum_L G_L: P's columns sum to one), and ``sum_K Z_K = M S``; every one holds at
every group element, so its maximum is an upper bound. Its matrix is
``2 m + sum_s n_s q_s`` square (a layer of d = f = 64 with 4 heads of 16: 512, where
the Shor lift would be 8192), and ``tr Y = 2 m + sum ||G_L||^2`` is fixed, so weak
duality certifies it exactly as above: ``b^T y - tr(Y) lambda_min(S) + (the
assignment's maximum of the multipliers' residual on p)``, every term in float64 from
the solver's multipliers. At a planted pair it is exact (Cauchy-Schwarz on each unit's
vectors); it is looser than the Shor lift (on the tiny residual MLPs of
tests/test_certify_gram.py 10-17% below the brute-force optimum where Shor is within
1.5%; on nanoGPT layers within 0.1% of it, bench/bench_gram.py), so where both fit the
larger bound is kept. Solved when the group is a star of size at most ``GRAM_LIMIT``.
"""

from __future__ import annotations

import math
import time
import warnings
from collections.abc import Mapping
from typing import Any

import attrs
import numpy as np
import torch

from ..groups import OC, Element, Group, Heads, O, S, centred_basis
from ..problem import Problem

#: the largest N = sum of the variables' squared sizes solved (the lifted matrix is N + 1
#: square); measured with SCS on 2 cores: N 41 in 0.2 s, 61 in 1 s, 100 in 1.5 s; 136
#: (two permutation spaces) in 22 s and 148 (one layer of a GPT, 12 units, 2 heads) in 40 s
JOINT_LIMIT = 100
#: the largest Gram relaxation solved (its PSD matrix is that square): 2 d plus one row per
#: vector a layer's spaces move against the residual, 512 for a layer of d = f = 64 with
#: 4 heads of 16; measured with SCS on 2 cores: 256 in 18 s, 512 in 100 s
GRAM_LIMIT = 600
#: SCS iterations at most (its inaccuracy loosens the certified bound, never breaks it)
SCS_ITERS = 1500

_EPS = float(torch.finfo(torch.float64).eps)
#: what a bound that cvxpy solves says without it (the SDP relaxations, the doubly
#: stochastic one): each such bound is listed, with this, in the certificate
NEEDS_CVXPY = "not available: needs cvxpy (pip install 'symspec[convex]')"


def have_cvxpy() -> bool:
    """Whether cvxpy imports (an optional dependency: the ``convex`` extra)."""
    try:
        import cvxpy  # noqa: F401
    except ImportError:
        return False
    return True


def noisy_gap(value: float | None, bound: float | None, noise: float) -> float | None:
    """``value - bound``, with a negative gap within the rounding level ``noise`` read as 0
    (a larger negative one is kept: it says the bound is wrong)."""
    if value is None or bound is None:
        return None
    g = value - bound
    return max(g, 0.0) if g > -noise else g


@attrs.frozen
class JointBound:
    """A joint bound over ``spaces`` (the others fixed at the result): ``value`` is the
    objective of the parameters they touch at the result, ``bound`` a lower bound on its
    minimum over them. ``scope``: ``all`` (every supported searched space; with none
    fixed, ``whole`` is True and value/bound cover the whole objective) or a layer."""

    scope: str
    spaces: tuple[str, ...]
    fixed: tuple[str, ...]
    size: int
    available: bool
    reason: str
    value: float | None = None
    bound: float | None = None
    whole: bool = False
    noise: float = 0.0
    seconds: float = 0.0
    #: the Gram relaxations' matrix sizes, summed (0 when none ran)
    gram_size: int = 0
    #: the objective of a better element than the result, found by rounding the Gram
    #: relaxation's solution (then coordinate ascent): proof that the result is at least
    #: ``value - found`` above the minimum; None when none was better
    found: float | None = None
    #: the relaxations this scope needed and could not solve without cvxpy
    needs_cvxpy: tuple[str, ...] = ()

    @property
    def gap(self) -> float | None:
        return noisy_gap(self.value, self.bound, self.noise)

    def to_dict(self) -> dict[str, Any]:
        g = self.gap
        return {"scope": self.scope, "spaces": list(self.spaces), "fixed": list(self.fixed), "lifted_size": self.size,
                "available": self.available, "reason": self.reason, "value": self.value, "bound": self.bound,
                "gap": g, "relative_gap": None if g is None or not self.value else g / self.value,
                "whole_objective": self.whole, "gram_size": self.gram_size, "found": self.found,
                "seconds": round(self.seconds, 4)}


def element_eps(elements: Mapping[str, Element]) -> float:
    """The rounding unit of the result's elements (float32 elements are orthogonal, and
    so act, only to float32 precision)."""
    eps = _EPS
    for e in elements.values():
        for t in e.values():
            if t.is_floating_point():
                eps = max(eps, float(torch.finfo(t.dtype).eps))
    return eps


# -- variables ---------------------------------------------------------------------------------

@attrs.frozen(eq=False)
class _Var:
    """rho(M) = sum_kl M_kl U[:, k, :] V[:, l, :]^T + E0 for every path of the space."""

    space: str
    kind: str  # "perm" or "orth"
    n: int  # M is n x n
    u: torch.Tensor  # [size, n, w]
    e0: torch.Tensor | None  # [size, size]
    offset: int = 0


def variable(group: Group) -> tuple[str, int, torch.Tensor, torch.Tensor | None] | None:
    """(kind, n, U, E0) of a searched group the relaxation models, else None."""
    if isinstance(group, S):
        return "perm", group.n, torch.eye(group.n, dtype=torch.float64)[:, :, None], None
    if isinstance(group, O):
        return "orth", group.n, torch.eye(group.n, dtype=torch.float64)[:, :, None], None
    if isinstance(group, OC) and group.n > 1:
        n = group.n
        return "orth", n - 1, centred_basis(n)[:, :, None], torch.full((n, n), 1.0 / n, dtype=torch.float64)
    if isinstance(group, Heads) and group.kv == group.heads and all(g.is_trivial() for _, g in group.parts):
        dhs = {g.n for _, g in group.parts}
        if len(dhs) != 1:
            return None
        dh, h = dhs.pop(), group.heads
        u = torch.einsum("hk,ab->hakb", torch.eye(h, dtype=torch.float64), torch.eye(dh, dtype=torch.float64))
        return "perm", h, u.reshape(h * dh, h, dh), None
    return None


def _value_of(var: _Var, group: Group, e: Element) -> torch.Tensor:
    """M at the result's element (in the spec's group ``group``)."""
    if isinstance(group, Heads):
        p = torch.zeros(var.n, var.n, dtype=torch.float64)
        p[torch.arange(var.n), e["perm"].long()] = 1.0
        return p
    m = group.matrix(e).double()
    if var.e0 is not None:  # OC: reduced
        b = var.u[:, :, 0]
        return b.T @ m @ b
    return m


# -- the quadratic model -----------------------------------------------------------------------

@attrs.define
class _Model:
    n: int
    k: float = 0.0  # sum ||A||^2 + ||B'||^2
    k0: float = 0.0  # constant inner products
    c: torch.Tensor | None = None
    #: the quadratic part, allocated by the first block with two variable axes (a model
    #: of uncoupled variables has none: its size is then linear in N, not quadratic)
    w: torch.Tensor | None = None
    constant: float = 0.0  # blocks no variable touches: ||A - g.B||^2 there
    #: False: no N x N matrix; every block with two variable axes must pair an orthogonal
    #: variable with a permutation, and is kept as factors (the Gram relaxation's input)
    dense: bool = True
    #: per (orthogonal, permutation) pair of variables: F, G [n, m, q] with the block's
    #: bilinear part ``sum_KL P_KL <F_K G_L^T, M>`` (M the orthogonal variable)
    factors: list[tuple[_Var, _Var, torch.Tensor, torch.Tensor]] = attrs.Factory(list)
    #: the star's hub (:func:`star_hub`): blocks pairing it with another variable are kept as factors
    hub: _Var | None = None

    def __attrs_post_init__(self) -> None:
        self.c = torch.zeros(self.n, dtype=torch.float64)

    def quadratic(self) -> torch.Tensor:
        if not self.dense:
            raise RuntimeError("a model built without its dense quadratic part")
        if self.w is None:
            self.w = torch.zeros(self.n, self.n, dtype=torch.float64)
        return self.w

    def inner(self, x: torch.Tensor) -> float:
        assert self.c is not None
        if self.dense:
            quad = 0.0 if self.w is None else float(x @ self.w @ x)
        else:
            quad = 0.0
            for vo, vp, f, g in self.factors:
                mo = x[vo.offset : vo.offset + vo.n**2].reshape(vo.n, vo.n)
                pm = x[vp.offset : vp.offset + vp.n**2].reshape(vp.n, vp.n)
                quad += float(torch.einsum("Kkq,kl,KL,Llq->", f, mo, pm, g))
        return self.k0 + float(self.c @ x) + quad

    def value(self, x: torch.Tensor) -> float:
        return self.constant + self.k - 2 * self.inner(x)


def _axis_front(t: torch.Tensor, axes: list[int]) -> torch.Tensor:
    """``t`` with ``axes`` moved to the front (in order) and the rest flattened into one."""
    rest = [d for d in range(t.ndim) if d not in axes]
    t = t.permute(*axes, *rest)
    return t.reshape(*t.shape[: len(axes)], -1)


def _apply_axis(m: torch.Tensor, t: torch.Tensor, axis: int) -> torch.Tensor:
    return torch.tensordot(m, t.movedim(axis, 0), dims=([1], [0])).movedim(0, axis)


def build_model(problem: Problem, a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor],
                elements: Mapping[str, Element], variables: dict[str, _Var], params: list[str],
                dense: bool = True, hub: _Var | None = None) -> _Model | str:
    """The quadratic model of the objective over ``params`` (module), or why not;
    ``dense=False``: the star-shaped model of the Gram relaxation (:attr:`_Model.factors`)."""
    total = sum(v.n * v.n for v in variables.values())
    model = _Model(total, dense=dense, hub=hub)
    assert model.c is not None
    for p in params:
        pb = problem.params[p]
        ta, tb = pb.viewed(a[p].double()), pb.viewed(b[p].double())  # as the axes see them
        for ab in pb.axes:  # head-major axes: act in the concatenated order
            if ab.layout is not None:
                ta = ab.layout.to_concat(ta.movedim(ab.axis, 0)).movedim(0, ab.axis)
                tb = ab.layout.to_concat(tb.movedim(ab.axis, 0)).movedim(0, ab.axis)
        # every combination of one segment per bound axis is a block
        combos: list[list[tuple[int, Any]]] = [[]]
        for ab in pb.axes:
            combos = [[*c, (ab.axis, seg)] for c in combos for seg in ab.segments]
        for combo in combos:
            idx: list[Any] = [slice(None)] * ta.ndim
            for axis, seg in combo:
                idx[axis] = slice(seg.start, seg.stop)
            ba, bb = ta[tuple(idx)], tb[tuple(idx)]
            var_axes: list[tuple[int, _Var, Any]] = []
            #: fixed factors applied after a variable (g.B = L M R B): L per variable axis
            after: list[tuple[int, _Var, torch.Tensor]] = []

            def fixed(factors: Any) -> torch.Tensor | None:
                m = None
                for f in factors:  # their matrices, factors[-1] acting first
                    g = problem.spaces[f.space].group
                    fm = g.matrix(elements[f.space], f.path, f.variance).double()  # type: ignore[arg-type]
                    m = fm if m is None else m @ fm
                return m

            for axis, seg in combo:
                at = [i for i, f in enumerate(seg.factors) if f.space in variables]
                if len(at) > 1:
                    return f"{p}: two variable spaces in a product of factors"
                if at:
                    (i,) = at
                    f = seg.factors[i]
                    right = fixed(seg.factors[i + 1 :])
                    if right is not None:  # acts before the variable: part of B
                        bb = _apply_axis(right, bb, axis)
                    left = fixed(seg.factors[:i])
                    var_axes.append((axis, variables[f.space], f))
                    if left is not None:
                        after.append((axis, variables[f.space], left))
                    continue
                m = fixed(seg.factors)
                if m is not None:
                    bb = _apply_axis(m, bb, axis)
            if not var_axes:
                model.constant += float((ba - bb).square().sum())
                continue
            if len(var_axes) > 2:
                return f"{p}: more than two variable axes"
            for _, v, f in var_axes:
                if f.variance == "abs" and v.kind != "perm":
                    return f"{p}: an abs factor of an orthogonal variable"
            model.k += float(ba.square().sum())
            b_norm = float(bb.square().sum())
            for axis, v, left in after:  # <A, L M B'> = <L^T A, M B'>; ||L M B'||^2 below
                ba = _apply_axis(left.T, ba, axis)
                gram = left.T @ left
                eye = torch.eye(gram.shape[0], dtype=gram.dtype)
                tol = 1e-9 * float(gram.abs().max())
                if float((gram - eye).abs().max()) <= tol:
                    continue  # orthogonal: the norm is B''s
                off = gram - torch.diag(torch.diagonal(gram))
                if v.kind != "perm" or len(after) > 1 or float(off.abs().max()) > tol:
                    return (f"{p}: {v.space} ({v.kind}) under a fixed factor that is not orthogonal "
                            "(only a permutation under a fixed diagonal one is modelled)")
                # ||L M B'||^2 = sum_kl M_kl w_kl: linear in a permutation (the other axis, if
                # variable, is orthogonal and does not change it); F gets it through -2 inner
                nb = _axis_front(bb, [axis]).square().sum(-1)
                w = torch.einsum("ika,i,jla,j->kl", v.u, torch.diagonal(gram), v.u, nb)
                assert model.c is not None
                model.c[v.offset : v.offset + v.n * v.n] -= 0.5 * w.reshape(-1)
                b_norm = 0.0
            model.k += b_norm
            why = _add_block(model, ba, bb, var_axes)
            if why is not None:
                return f"{p}: {why}"
    return model


def _lin(model: _Model, v: _Var, a2: torch.Tensor, b2: torch.Tensor) -> None:
    """<a2, rho(M) b2> for a2, b2 [size, m]: its M-linear part into c, its E0 part into k0."""
    assert model.c is not None
    ua = torch.einsum("iku,im->kum", v.u, a2)
    ub = torch.einsum("ilu,im->lum", v.u, b2)
    model.c[v.offset : v.offset + v.n * v.n] += torch.einsum("kum,lum->kl", ua, ub).reshape(-1)
    if v.e0 is not None:
        model.k0 += float((a2 * (v.e0 @ b2)).sum())


def _add_block(model: _Model, ba: torch.Tensor, bb: torch.Tensor, var_axes: list[tuple[int, _Var, Any]]) -> str | None:
    """Add one block's terms to the model; or why the (non-dense) model cannot hold it."""
    if len(var_axes) == 1:
        axis, v, _ = var_axes[0]
        _lin(model, v, _axis_front(ba, [axis]), _axis_front(bb, [axis]))
        return None
    (ai, vi, _), (aj, vj, _) = var_axes
    a3, b3 = _axis_front(ba, [ai, aj]), _axis_front(bb, [ai, aj])  # [ni, nj, r]
    # the bilinear part: sum M_kl N_k'l' <A, U_k V_l^T B V'_l' U'_k'^T>
    at = torch.einsum("iku,ijr,jKv->kKuvr", vi.u, a3, vj.u)
    bt = torch.einsum("ilu,ijr,jLv->lLuvr", vi.u, b3, vj.u)
    star = model.hub is not None and vi is not vj and (vi is model.hub or vj is model.hub)
    if star:  # the same coefficients as factors: F_K, G_L [m, q] per index of the leaf
        if vi is model.hub:
            f, g = at.movedim(1, 0), bt.movedim(1, 0)
            vo, vp = vi, vj
        else:
            f, g, vo, vp = at, bt, vj, vi
        model.factors.append((vo, vp, f.reshape(vp.n, vo.n, -1), g.reshape(vp.n, vo.n, -1)))
    elif not model.dense:
        return ("a variable on two axes of one parameter" if vi is vj
                else f"two spaces other than the hub on one parameter ({vi.space}, {vj.space})")
    if model.dense:
        w = model.quadratic()
        wb = torch.einsum("kKuvr,lLuvr->klKL", at, bt).reshape(vi.n * vi.n, vj.n * vj.n)
        si, sj = slice(vi.offset, vi.offset + vi.n**2), slice(vj.offset, vj.offset + vj.n**2)
        if vi is vj:
            w[si, si] += 0.5 * (wb + wb.T)
        else:
            w[si, sj] += 0.5 * wb
            w[sj, si] += 0.5 * wb.T
    # the affine parts: M-part x E0', E0 x N-part, E0 x E0'
    if vj.e0 is not None:
        b_j = torch.einsum("ijr,Jj->iJr", b3, vj.e0)
        _lin(model, attrs.evolve(vi, e0=None), a3.reshape(a3.shape[0], -1), b_j.reshape(b_j.shape[0], -1))
    if vi.e0 is not None:
        b_i = torch.einsum("Ii,ijr->Ijr", vi.e0, b3)
        _lin(model, attrs.evolve(vj, e0=None), a3.permute(1, 0, 2).reshape(a3.shape[1], -1),
             b_i.permute(1, 0, 2).reshape(b_i.shape[1], -1))
        if vj.e0 is not None:
            model.k0 += float((a3 * torch.einsum("ijr,Jj->iJr", b_i, vj.e0)).sum())
    return None


# -- the relaxation ----------------------------------------------------------------------------

def _constraints(variables: list[_Var], size: int) -> tuple[Any, np.ndarray, Any]:
    """(A, b, Sel) over vec(Y), column-major, every row symmetrised (module)."""
    from scipy import sparse  # type: ignore[import-untyped]

    n1 = size + 1
    rows: list[dict[tuple[int, int], float]] = []
    rhs: list[float] = []

    def add(coef: dict[tuple[int, int], float], value: float) -> None:
        rows.append(coef)
        rhs.append(value)

    def idx(v: _Var, k: int, lcol: int) -> int:
        return 1 + v.offset + k * v.n + lcol

    add({(0, 0): 1.0}, 1.0)
    perm_idx: list[int] = []
    for v in variables:
        n = v.n
        for i in range(n):
            for j in range(i, n):
                # M M^T = I and M^T M = I on X
                add({(idx(v, i, k), idx(v, j, k)): 1.0 for k in range(n)}, float(i == j))
                add({(idx(v, k, i), idx(v, k, j)): 1.0 for k in range(n)}, float(i == j))
        if v.kind != "perm":
            continue
        entries = [idx(v, k, col) for k in range(n) for col in range(n)]
        perm_idx += entries
        for e in entries:  # binary: X_ee = x_e
            add({(e, e): 1.0, (0, e): -1.0}, 0.0)
        own = range(1 + v.offset, 1 + v.offset + n * n)
        for k in range(n):  # row and column sums, alone and times each of the variable's own entries
            for q in [0, *own]:
                rsum = {(idx(v, k, col), q): 1.0 for col in range(n)}
                csum = {(idx(v, col, k), q): 1.0 for col in range(n)}
                if q == 0:
                    add(rsum, 1.0)
                    add(csum, 1.0)
                else:
                    rsum[(0, q)] = rsum.get((0, q), 0.0) - 1.0
                    csum[(0, q)] = csum.get((0, q), 0.0) - 1.0
                    add(rsum, 0.0)
                    add(csum, 0.0)
    data, ri, ci = [], [], []
    for r, coef in enumerate(rows):
        acc: dict[int, float] = {}
        for (i, j), val in coef.items():
            acc[i + j * n1] = acc.get(i + j * n1, 0.0) + 0.5 * val
            acc[j + i * n1] = acc.get(j + i * n1, 0.0) + 0.5 * val
        for col, val in acc.items():
            ri.append(r)
            ci.append(col)
            data.append(val)
    amat = sparse.csr_matrix((data, (ri, ci)), shape=(len(rows), n1 * n1))
    # nonnegative entries: x and X between permutation entries (upper triangle, first row)
    nn = [(0, e) for e in perm_idx] + [(e, f) for i, e in enumerate(perm_idx) for f in perm_idx[i:]]
    sr = np.arange(len(nn))
    sel = sparse.csr_matrix((np.ones(len(nn)), (sr, [i + j * n1 for i, j in nn])), shape=(len(nn), n1 * n1)) if nn else None
    return amat, np.asarray(rhs), sel


def _sym(vec: np.ndarray, n1: int) -> np.ndarray:
    m = vec.reshape(n1, n1, order="F")
    return 0.5 * (m + m.T)


class SDPFailed(RuntimeError):
    """The relaxation could not be solved (the bound is then not available)."""


def _solve(prob: Any, constraint: Any, eps: float) -> str:
    """Solve ``prob`` (SCS, Clarabel if SCS fails and the problem is small) for
    ``constraint``'s multipliers; the solver's name. SCS (first order) is ~10x faster
    than Clarabel's interior point here, whose KKT system is dense in a PSD cone's
    entries (a 574 x 574 Gram matrix: 218 GB); its inaccuracy costs only tightness,
    never validity (the callers certify the bound from the multipliers). Ctrl-C during
    SCS is KeyboardInterrupt (:func:`symspec.solvers.convex.solve`), never a retry."""
    import cvxpy as cp

    from ..solvers.convex import INTERIOR_POINT_MAX_BYTES, interior_point_bytes, solve

    used = "SCS"
    with warnings.catch_warnings():  # "may be inaccurate": the certificate accounts for it
        warnings.filterwarnings("ignore", message="Solution may be inaccurate")
        try:
            solve(prob, cp.SCS, eps=eps, max_iters=SCS_ITERS)
        except cp.error.SolverError as e:
            need = interior_point_bytes(prob)
            if need > INTERIOR_POINT_MAX_BYTES:
                raise SDPFailed(f"SCS failed ({e}) and Clarabel would need about {need / 2**30:.0f} GiB") from e
            used = "CLARABEL"
            try:
                prob.solve(solver=cp.CLARABEL)
            except cp.error.SolverError as e2:
                raise SDPFailed(f"SCS and Clarabel failed ({e2})") from e2
    if constraint.dual_value is None:
        raise SDPFailed(f"the SDP solver returned no multipliers ({prob.status})")
    return used


def solve_relaxation(model: _Model, variables: list[_Var]) -> tuple[float, str]:
    """(certified upper bound on max <C~, Y> over the relaxation, the solver used)."""
    import cvxpy as cp

    assert model.c is not None
    size = model.n
    n1 = size + 1
    w = model.quadratic()
    ctil = np.zeros((n1, n1))
    ctil[0, 1:] = ctil[1:, 0] = 0.5 * model.c.numpy()
    ctil[1:, 1:] = 0.5 * (w + w.T).numpy()
    amat, b, sel = _constraints(variables, size)
    y = cp.Variable((n1, n1), PSD=True)
    vec = cp.vec(y, order="F")
    cons = [amat @ vec == b]
    if sel is not None:
        cons.append(sel @ vec >= 0)
    used = _solve(cp.Problem(cp.Maximize(cp.sum(cp.multiply(ctil, y))), cons), cons[0], 1e-6)
    tmax = 1.0 + sum(v.n for v in variables)
    best = math.inf
    for sign in (1.0, -1.0):  # whichever sign convention the solver's multipliers follow
        yv = sign * np.asarray(cons[0].dual_value, dtype=np.float64).reshape(-1)
        smat = _sym(amat.T @ yv, n1) - ctil
        if sel is not None:
            zv = np.clip(sign * np.asarray(cons[1].dual_value, dtype=np.float64).reshape(-1), 0.0, None)
            smat = smat - _sym(sel.T @ zv, n1)
        lam = float(np.linalg.eigvalsh(0.5 * (smat + smat.T))[0])
        best = min(best, float(b @ yv) + max(0.0, -lam) * tmax)
    return best, used


class _Rows:
    """Equality rows ``<A_Y, Y> + <A_p, p> = b`` over a symmetric matrix Y (column-major
    vec, each entry's coefficient split between (i, j) and (j, i)) and a vector p."""

    def __init__(self, size: int, np_: int) -> None:
        self.size, self.np = size, np_
        self.n = 0
        self.yr: list[np.ndarray] = []
        self.yc: list[np.ndarray] = []
        self.yv: list[np.ndarray] = []
        self.pr: list[np.ndarray] = []
        self.pc: list[np.ndarray] = []
        self.pv: list[np.ndarray] = []
        self.b: list[np.ndarray] = []

    def new(self, count: int, rhs: Any = 0.0) -> np.ndarray:
        """``count`` new rows (their indices), right-hand sides ``rhs``."""
        rows = np.arange(self.n, self.n + count)
        self.n += count
        self.b.append(np.broadcast_to(np.asarray(rhs, dtype=np.float64), (count,)).copy())
        return rows

    def y(self, rows: np.ndarray, i: np.ndarray, j: np.ndarray, v: Any = 1.0) -> None:
        rows, i, j, v = np.broadcast_arrays(rows, i, j, np.asarray(v, dtype=np.float64))
        rows, i, j, v = rows.ravel(), i.ravel(), j.ravel(), v.ravel()
        self.yr += [rows, rows]
        self.yc += [i + j * self.size, j + i * self.size]
        self.yv += [0.5 * v, 0.5 * v]

    def p(self, rows: np.ndarray, idx: np.ndarray, v: Any) -> None:
        rows, idx, v = np.broadcast_arrays(rows, idx, np.asarray(v, dtype=np.float64))
        self.pr.append(rows.ravel())
        self.pc.append(idx.ravel())
        self.pv.append(v.ravel())

    def matrices(self) -> tuple[Any, Any, np.ndarray]:
        from scipy import sparse  # type: ignore[import-untyped]

        def cat(parts: list[np.ndarray], dtype: Any) -> np.ndarray:
            return np.concatenate(parts).astype(dtype) if parts else np.zeros(0, dtype=dtype)

        ay = sparse.csr_matrix((cat(self.yv, np.float64), (cat(self.yr, np.int64), cat(self.yc, np.int64))),
                               shape=(self.n, self.size * self.size))
        ap = sparse.csr_matrix((cat(self.pv, np.float64), (cat(self.pr, np.int64), cat(self.pc, np.int64))),
                               shape=(self.n, self.np))
        return ay, ap, cat(self.b, np.float64)


def gram_relaxation(model: _Model, variables: list[_Var], rounded: dict[str, Any] | None = None) -> tuple[float, str]:
    """(certified upper bound on the inner part's maximum minus ``k0``, the solver used)
    for a star (``model.hub``, built with it): see the module docstring. ``rounded``: if
    given, receives ``x``, a group element (the model's variables) rounded from the
    relaxation's solution and improved by :func:`star_descent`."""
    import cvxpy as cp

    assert model.c is not None and model.hub is not None
    vo = model.hub
    perms = [v for v in variables if v is not vo]
    m = vo.n
    stacks: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for o, v, f, g in model.factors:
        assert o is vo
        if v.space in stacks:
            f0, g0 = stacks[v.space]
            f, g = torch.cat([f0, f], -1), torch.cat([g0, g], -1)
        stacks[v.space] = (f, g)
    base, poff = {}, {}
    size, np_ = 2 * m, 0
    if vo.kind == "perm":  # a permutation hub: M is also doubly stochastic (its entries in p)
        poff[vo.space] = np_
        np_ += m * m
    for v in perms:
        q = stacks[v.space][0].shape[-1] if v.space in stacks else 0
        base[v.space], poff[v.space] = size, np_
        size += v.n * q
        np_ += v.n * v.n
    rows = _Rows(size, np_)
    ar = np.arange
    iu = np.triu_indices(m)
    for off in (0, m):  # the two identity blocks
        r = rows.new(len(iu[0]), (iu[0] == iu[1]).astype(np.float64))
        rows.y(r, iu[0] + off, iu[1] + off)
    ctil = np.zeros((size, size))
    c_o = model.c[vo.offset : vo.offset + m * m].reshape(m, m).numpy()
    ctil[:m, m : 2 * m] += c_o  # one triangle, then symmetrised: <ctil, Y> = <C_o, M> + ...
    trace = 2.0 * m
    cp_obj = np.zeros(np_)
    if vo.kind == "perm":
        hidx = poff[vo.space] + np.arange(m)[:, None] * m + np.arange(m)[None, :]
        for sums in (hidx, hidx.T):
            rows.p(rows.new(m, 1.0)[:, None], sums, 1.0)
        r = rows.new(m * m).reshape(m, m)  # Y[k, m + l] = M_kl
        rows.y(r, np.arange(m)[:, None], m + np.arange(m)[None, :])
        rows.p(r, hidx, -1.0)
    for v in perms:
        n, b0, p0 = v.n, base[v.space], poff[v.space]
        cp_obj[p0 : p0 + n * n] = model.c[v.offset : v.offset + n * n].numpy()
        pidx = p0 + ar(n)[:, None] * n + ar(n)[None, :]  # [K, L]
        r = rows.new(n, 1.0)  # row and column sums
        rows.p(r[:, None], pidx, 1.0)
        r = rows.new(n, 1.0)
        rows.p(r[:, None], pidx.T, 1.0)
        if v.space not in stacks:
            continue
        f, g = (t.numpy() for t in stacks[v.space])  # [n, m, q]
        q = f.shape[-1]
        trace += float((g * g).sum())
        zcol = b0 + ar(n)[:, None] * q + ar(q)[None, :]  # [K, a]
        ctil[:m, zcol.reshape(-1)] += f.transpose(1, 0, 2).reshape(m, n * q)
        # V_K = sum_L P_KL G_L: Y[m + l, (K, a)]
        r = rows.new(m * n * q).reshape(m, n, q)
        rows.y(r, (m + ar(m))[:, None, None], zcol[None])
        rows.p(r[..., None], pidx[None, :, None, :], -g.transpose(1, 2, 0)[:, None, :, :])
        # the diagonal blocks of W: W_KK = sum_L P_KL G_L^T G_L
        gg = np.einsum("Lka,Lkb->Lab", g, g)  # [L, q, q]
        ia, ib = np.triu_indices(q)
        r = rows.new(n * len(ia)).reshape(n, len(ia))
        rows.y(r, zcol[:, ia], zcol[:, ib])
        rows.p(r[..., None], pidx[:, None, :], -gg[:, ia, ib].T[None, :, :])
        # W's block rows: sum_K' W_KK' = sum_L P_KL G_L^T S, S = sum_L G_L
        gs = np.einsum("Lka,kb->Lab", g, g.sum(0))  # [L, q, q]
        r = rows.new(n * q * q).reshape(n, q, q)
        rows.y(r[..., None], zcol[:, :, None, None], zcol.T[None, None, :, :])
        rows.p(r[..., None], pidx[:, None, None, :], -gs.transpose(1, 2, 0)[None])
        # sum_K Z_K = M S (linear in M: Y[k, m + l] S[l, a])
        r = rows.new(m * q).reshape(m, q)
        rows.y(r[..., None], ar(m)[:, None, None], zcol.T[None, :, :])
        rows.y(r[..., None], ar(m)[:, None, None], (m + ar(m))[None, None, :], -g.sum(0).T[None, :, :])
    ay, ap, b = rows.matrices()
    ctil = 0.5 * (ctil + ctil.T)
    y = cp.Variable((size, size), PSD=True)
    p = cp.Variable(np_, nonneg=True)
    eq = ay @ cp.vec(y, order="F") + ap @ p == b
    used = _solve(cp.Problem(cp.Maximize(cp.sum(cp.multiply(ctil, y)) + cp_obj @ p), [eq]), eq, 1e-7)
    best = math.inf
    for sign in (1.0, -1.0):
        yv = sign * np.asarray(eq.dual_value, dtype=np.float64).reshape(-1)
        smat = _sym(ay.T @ yv, size) - ctil
        lam = float(np.linalg.eigvalsh(smat)[0])
        resid = cp_obj - ap.T @ yv
        total = float(b @ yv) - trace * lam
        total += size * 8 * _EPS * float(np.linalg.norm(smat)) * trace
        for v in [vo, *perms] if vo.kind == "perm" else perms:  # p: the assignment's maximum over Birkhoff
            rv = resid[poff[v.space] : poff[v.space] + v.n * v.n].reshape(v.n, v.n)
            total += _group_max("perm", torch.as_tensor(rv))
        best = min(best, total)
    if rounded is not None and p.value is not None and y.value is not None:
        x = torch.zeros(model.n, dtype=torch.float64)
        pv = torch.as_tensor(np.asarray(p.value, dtype=np.float64))
        for v in [vo, *perms]:  # the nearest permutations and orthogonal map to the relaxed ones
            sol = (pv[poff[v.space] : poff[v.space] + v.n * v.n].reshape(v.n, v.n) if v.kind == "perm"
                   else torch.as_tensor(np.asarray(y.value, dtype=np.float64)[:m, m : 2 * m]))
            x[v.offset : v.offset + v.n * v.n] = _group_argmax(v.kind, sol).reshape(-1)
        rounded["x"] = star_descent(model, variables, x)
    return best, used


def star_descent(model: _Model, variables: list[_Var], x: torch.Tensor, rounds: int = 20) -> torch.Tensor:
    """Coordinate ascent on a star's inner part from ``x``: the hub given the leaves
    (Procrustes or an assignment: linear in it), then every leaf given the hub (an
    assignment), until nothing improves; a group element whatever the start was."""
    assert model.c is not None and model.hub is not None
    hub = model.hub
    x = x.clone()

    def best(v: _Var, c: torch.Tensor) -> None:
        x[v.offset : v.offset + v.n * v.n] = _group_argmax(v.kind, c).reshape(-1)

    def part(v: _Var) -> torch.Tensor:
        assert model.c is not None
        return model.c[v.offset : v.offset + v.n * v.n].reshape(v.n, v.n).clone()

    last = model.inner(x)
    for _ in range(rounds):
        c = part(hub)
        for _, vp, f, g in model.factors:
            pm = x[vp.offset : vp.offset + vp.n**2].reshape(vp.n, vp.n)
            c += torch.einsum("Kkq,KL,Llq->kl", f, pm, g)
        best(hub, c)
        mo = x[hub.offset : hub.offset + hub.n**2].reshape(hub.n, hub.n)
        for v in variables:
            if v is hub:
                continue
            c = part(v)
            for _, vp, f, g in model.factors:
                if vp is v:
                    c += torch.einsum("Kkq,kl,Llq->KL", f, mo, g)
            best(v, c)
        now = model.inner(x)
        if now <= last + 1e-12 * max(1.0, abs(last)):
            break
        last = now
    return x


# -- components ----------------------------------------------------------------------------------

def interactions(problem: Problem, chosen: list[str]) -> tuple[set[frozenset[str]], set[str]]:
    """(the pairs of ``chosen`` spaces that one parameter carries on two of its axes, the
    spaces a parameter carries on two axes: quadratic in their variable)."""
    edges: set[frozenset[str]] = set()
    quadratic: set[str] = set()
    wanted = set(chosen)
    for pb in problem.params.values():
        on_axes = [got for ab in pb.axes
                   if (got := {f.space for seg in ab.segments for f in seg.factors if f.space in wanted})]
        if len(on_axes) < 2:
            continue
        seen: set[str] = set()
        for got in on_axes:
            quadratic |= got & seen
            edges |= {frozenset((s, t)) for s in got for t in seen if s != t}
            seen |= got
    return edges, quadratic


def components(problem: Problem, chosen: list[str]) -> list[tuple[tuple[str, ...], bool]]:
    """``chosen`` split into the groups of spaces that interact: two spaces interact when
    one parameter carries them on two of its axes (their blocks are bilinear in the two
    variables); a space on two axes of one parameter interacts with itself (quadratic).
    Per group: (its spaces, whether it interacts at all). The objective's inner part is
    a sum over the groups, each over its own variables, so its maximum is the sum of the
    groups' maxima; a group that does not interact is linear in its variable and is
    maximised exactly (:func:`linear_max`)."""
    import networkx as nx

    edges, quadratic = interactions(problem, chosen)
    graph = nx.Graph()
    graph.add_nodes_from(chosen)
    graph.add_edges_from(tuple(e) for e in edges)
    groups = sorted(([s for s in chosen if s in comp] for comp in nx.connected_components(graph)),
                    key=lambda m: chosen.index(m[0]))
    return [(tuple(m), len(m) > 1 or m[0] in quadratic) for m in groups]


def star_hub(problem: Problem, members: tuple[str, ...], kinds: Mapping[str, str], ns: Mapping[str, int]) -> str | None:
    """The hub of a star-shaped group of interacting spaces: the one space every
    interaction involves (the others, permutations, interact with it alone, none with
    itself), an orthogonal map or a permutation (relaxed to the orthogonal group plus its
    permutation constraints); None if the group is not a star."""
    edges, quadratic = interactions(problem, list(members))
    if len(members) < 2 or quadratic & set(members):
        return None
    hubs = [s for s in members if all(s in e for e in edges)]
    if len(members) == 2:  # either end: the orthogonal one, else the wider
        hubs.sort(key=lambda s: (kinds[s] != "orth", -ns[s]))
    for h in hubs:
        if all(kinds[s] == "perm" for s in members if s != h):
            return h
    return None


def gram_size(problem: Problem, members: tuple[str, ...], hub: str, m: int) -> int:
    """The Gram relaxation's matrix size for a star: 2 m (the hub's variable m x m) plus
    one row per vector the leaves move against the hub (a parameter with the hub on one
    axis and a leaf on another contributes its size over the hub axis' size)."""
    rows = 0
    leaves = set(members) - {hub}
    for pb in problem.params.values():
        hub_axes = [ab for ab in pb.axes if any(f.space == hub for seg in ab.segments for f in seg.factors)]
        if hub_axes and any(f.space in leaves for ab in pb.axes for seg in ab.segments for f in seg.factors):
            rows += math.prod(pb.shape) // max(1, pb.shape[hub_axes[0].axis])
    return 2 * m + rows


def linear_max(model: _Model, v: _Var) -> float:
    """max over the variable's group of ``c^T vec(M)`` (a model with no quadratic part):
    see :func:`_group_max`."""
    assert model.c is not None
    return _group_max(v.kind, model.c[v.offset : v.offset + v.n * v.n].reshape(v.n, v.n))


def _group_max(kind: str, c: torch.Tensor) -> float:
    """max of ``<c, M>`` over the permutations (``kind`` "perm": the assignment's optimum)
    or the orthogonal maps (the nuclear norm: the Procrustes value); plus a margin for
    rounding (n^2 eps ||C||_F), so an upper bound."""
    n = c.shape[0]
    if kind == "perm":
        from scipy.optimize import linear_sum_assignment  # type: ignore[import-untyped]

        rows, cols = linear_sum_assignment(c.numpy(), maximize=True)
        best = float(c[torch.as_tensor(rows), torch.as_tensor(cols)].sum())
    else:
        best = float(torch.linalg.svdvals(c).sum())
    return best + 4 * n * n * _EPS * float(torch.linalg.vector_norm(c))


def _group_argmax(kind: str, c: torch.Tensor) -> torch.Tensor:
    """The element M maximising ``<c, M>``: a permutation matrix (the assignment) for
    ``kind`` "perm", else the orthogonal polar factor U V^T."""
    if kind == "perm":
        from scipy.optimize import linear_sum_assignment  # type: ignore[import-untyped]

        rows, cols = linear_sum_assignment(c.numpy(), maximize=True)
        m = torch.zeros_like(c)
        m[torch.as_tensor(rows), torch.as_tensor(cols)] = 1.0
        return m
    u, _, vh = torch.linalg.svd(c)
    return u @ vh


# -- scopes --------------------------------------------------------------------------------------

@attrs.frozen
class _Fit:
    """How one group of interacting spaces is relaxed: the Shor lift's N (solved when
    at most ``limit``) and, for a star, its hub and the Gram relaxation's size (solved when
    at most ``gram_limit``)."""

    members: tuple[str, ...]
    n: int
    hub: str | None
    gram: int
    shor: bool
    gram_ok: bool

    @property
    def ok(self) -> bool:
        return self.shor or self.gram_ok


def _fits(problem: Problem, spaces: list[str], supported: Mapping[str, tuple[str, int, torch.Tensor, torch.Tensor | None]],
          limit: int, gram_limit: int) -> list[_Fit]:
    """The interacting groups among ``spaces`` and how each would be relaxed."""
    kinds = {s: supported[s][0] for s in spaces}
    ns = {s: supported[s][1] for s in spaces}
    out = []
    for m, coupled in components(problem, spaces):
        if not coupled:
            continue
        n = sum(ns[s] ** 2 for s in m)
        hub = star_hub(problem, m, kinds, ns)
        g = gram_size(problem, m, hub, ns[hub]) if hub is not None else 0
        out.append(_Fit(m, n, hub, g, n <= limit, hub is not None and g <= gram_limit))
    return out


def _too_large(fits: list[_Fit], limit: int, gram_limit: int,
               supported: Mapping[str, tuple[str, int, torch.Tensor, torch.Tensor | None]]) -> str:
    def one(f: _Fit) -> str:
        spaces = ", ".join(f"{s}: n={supported[s][1]}" for s in f.members)
        gram = (f"Gram size {f.gram} > {gram_limit}" if f.hub is not None
                else "not a star (no Gram relaxation)")
        return f"interacting spaces {spaces}: lifted size N = {f.n} > {limit}, {gram}"

    return "not available: too large (" + "; ".join(one(f) for f in fits if not f.ok) + ")"


def joint_bounds(problem: Problem, searched: Problem, canonical_a: Mapping[str, torch.Tensor],
                 canonical_b: Mapping[str, torch.Tensor], elements: Mapping[str, Element],
                 limit: int = JOINT_LIMIT, gram_limit: int = GRAM_LIMIT) -> list[JointBound]:
    """The joint bound over every supported searched space when each group of
    interacting spaces fits a relaxation (the Shor lift's N at most ``limit``, or a star's
    Gram size at most ``gram_limit``), else per layer (the spaces of one index, with the
    unindexed ones such as the residual when they fit); each scope's other spaces fixed
    at the result."""
    supported: dict[str, tuple[str, int, torch.Tensor, torch.Tensor | None]] = {}
    unsupported: list[str] = []
    for s, si in searched.spaces.items():
        g = si.group
        if g.is_trivial() or not problem.params_of(s):
            continue
        got = variable(g)
        if got is None:
            unsupported.append(s)
        else:
            supported[s] = got
    for s in list(supported):  # in a product of factors, the others must stay fixed
        if any(f.space != s and f.space in supported for inc in problem.incidences(s) for f in inc.segment.factors):
            unsupported.append(s)
            del supported[s]
    note = ""
    if unsupported:
        kinds = sorted({str(searched.spaces[s].group) for s in unsupported})
        note = (f"; fixed at the result (not modelled by the relaxation: {', '.join(kinds[:3])}): "
                f"{', '.join(unsupported[:6])}" + (f" and {len(unsupported) - 6} more" if len(unsupported) > 6 else ""))
    if not supported:
        return [JointBound("all", (), tuple(unsupported), 0, False,
                           "not available: no searched space is a permutation, head permutation, O or OC" + note)]

    def fits(spaces: list[str]) -> list[_Fit]:
        return _fits(problem, spaces, supported, limit, gram_limit)

    def scope(name: str, chosen: list[str], whole: bool = False) -> JointBound:
        return _scope(problem, canonical_a, canonical_b, elements, name, chosen, supported, note, whole=whole,
                      limit=limit, gram_limit=gram_limit)

    if all(f.ok for f in fits(list(supported))):
        return [scope("all", list(supported), whole=not unsupported)]
    out = []
    layers = sorted({si.index for s, si in problem.spaces.items() if s in supported and si.index is not None})
    shared = [s for s in supported if problem.spaces[s].index is None]
    for i in layers:
        own = [s for s in supported if problem.spaces[s].index == i]
        chosen = own + shared if all(f.ok for f in fits(own + shared)) else own
        got = fits(chosen)
        if not all(f.ok for f in got):
            out.append(JointBound(f"layer {i}", tuple(chosen), (), sum(f.n for f in got), False,
                                  _too_large(got, limit, gram_limit, supported) + note))
            continue
        out.append(scope(f"layer {i}", chosen))
    if not layers:
        got = fits(list(supported))
        out.append(JointBound("all", tuple(supported), (), sum(f.n for f in got), False,
                              _too_large(got, limit, gram_limit, supported) + note))
    return out


def _scope(problem: Problem, a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor],
           elements: Mapping[str, Element], scope: str, chosen: list[str],
           supported: Mapping[str, tuple[str, int, torch.Tensor, torch.Tensor | None]], note: str,
           whole: bool = False, limit: int = JOINT_LIMIT, gram_limit: int = GRAM_LIMIT) -> JointBound:
    """The bound over ``chosen`` (the others fixed): per group of interacting spaces
    (:func:`components`) the Shor relaxation where it fits and the Gram relaxation where
    the group is a star that fits (both: the smaller bound), per space that interacts with
    none its exact maximum; the parameters no chosen space touches are constants."""
    t0 = time.perf_counter()
    fixed = tuple(s for s in problem.spaces if s not in chosen and not problem.spaces[s].group.is_trivial())
    params = [p for p, pb in problem.params.items() if whole or pb.spaces() & set(chosen)]
    eps = element_eps(elements)
    elems = {s: problem.spaces[s].group.to(e, dtype=torch.float64) for s, e in elements.items()}
    sizes = {s: supported[s][1] ** 2 for s in chosen}
    groups = components(problem, chosen)
    fit = {f.members: f for f in _fits(problem, chosen, supported, limit, gram_limit)}
    lifted = sum(f.n for f in fit.values() if f.shor)
    grams = sum(f.gram for f in fit.values() if f.gram_ok)
    if not all(f.ok for f in fit.values()):
        return JointBound(scope, tuple(chosen), fixed, lifted, False,
                          _too_large(list(fit.values()), limit, gram_limit, supported) + note)
    needed = [f"the {name} SDP relaxation over {', '.join(members)}" for members, coupled in groups if coupled
              for name, used in (("Shor", fit[members].shor), ("Gram", fit[members].gram_ok and fit[members].hub is not None))
              if used]
    if needed and not have_cvxpy():  # said before any work, with every relaxation it needed
        return JointBound(scope, tuple(chosen), fixed, lifted, False, f"{'; '.join(needed)}: {NEEDS_CVXPY}" + note,
                          needs_cvxpy=tuple(needed))
    value = bound = scale = 0.0
    covered: set[str] = set()
    solvers: set[str] = set()
    exact: list[str] = []
    relaxed: list[str] = []
    gram_relaxed: list[str] = []
    improved = 0.0  # how much lower the rounded relaxations' elements are than the result
    for members, coupled in groups:
        f = fit.get(members)
        variables: dict[str, _Var] = {}
        offset = 0
        for s in members:
            kind, n, u, e0 = supported[s]
            variables[s] = _Var(s, kind, n, u, e0, offset)
            offset += n * n
        own = [p for p in params if problem.params[p].spaces() & set(members)]
        covered.update(own)
        hub = variables[f.hub] if f is not None and f.gram_ok and f.hub is not None else None
        model = build_model(problem, a, b, elems, variables, own, dense=f is None or f.shor, hub=hub)
        if isinstance(model, str):
            return JointBound(scope, tuple(chosen), fixed, lifted, False, f"not available: {model}" + note)
        x = torch.cat([_value_of(v, problem.spaces[s].group, elems[s]).reshape(-1) for s, v in variables.items()])
        if coupled:
            assert f is not None
            uppers = []
            try:
                if f.shor:
                    upper, used = solve_relaxation(model, list(variables.values()))
                    uppers.append(upper)
                    solvers.add(used)
                    relaxed.extend(members)
                if hub is not None:
                    rounded: dict[str, Any] = {}
                    upper, used = gram_relaxation(model, list(variables.values()), rounded)
                    if "x" in rounded:  # an element the relaxation points at: better than the result?
                        improved += max(0.0, model.value(x) - model.value(rounded["x"]))
                    uppers.append(upper)
                    solvers.add(used)
                    gram_relaxed.extend(members)
            except ImportError:  # cvxpy imports, a solver module of it does not
                return JointBound(scope, tuple(chosen), fixed, lifted, False, f"{'; '.join(needed)}: {NEEDS_CVXPY}" + note,
                                  needs_cvxpy=tuple(needed))
            except SDPFailed as e:
                return JointBound(scope, tuple(chosen), fixed, lifted, False, f"not available: {e}" + note)
            upper = min(uppers)
        else:
            (v,) = variables.values()
            upper = linear_max(model, v)
            exact.append(members[0])
        value += model.value(x)
        bound += model.constant + model.k - 2 * (model.k0 + upper)
        scale += model.k + model.constant
    rest = [p for p in params if p not in covered]
    if rest:  # untouched by the chosen spaces: ||A - g.B||^2 with the fixed spaces applied
        const = build_model(problem, a, b, elems, {}, rest)
        assert not isinstance(const, str)
        value += const.constant
        bound += const.constant
        scale += const.constant
    value = max(value, 0.0)
    # the result's elements are orthogonal to their own precision: ||g.B|| = ||B|| only to that
    noise = 64 * math.sqrt(sum(sizes.values()) + 1) * eps * scale
    # the model must reproduce the objective at the result: a check on its construction
    from ..transforms import apply_elements

    moved = apply_elements(problem, elems, {p: b[p].double() for p in params})
    direct = sum(float((a[p].double() - moved[p]).square().sum()) for p in params)
    if abs(direct - value) > max(noise, 1e-9 * scale):
        return JointBound(scope, tuple(chosen), fixed, lifted, False,
                          f"not available: the model does not reproduce the objective ({value:.6g} vs {direct:.6g})" + note)
    bound = max(bound, 0.0)
    what = ("a lower bound on the global minimum" if whole else "a lower bound on the minimum over these spaces, "
            "the others fixed at the result")
    how = []
    if relaxed:
        how.append(f"Shor SDP relaxation ({', '.join(sorted(solvers))}) over the interacting spaces "
                   f"{', '.join(relaxed)}, certified by weak duality")
    if gram_relaxed:
        how.append(f"Gram SDP relaxation ({', '.join(sorted(solvers))}) over the star-shaped interacting spaces "
                   f"{', '.join(gram_relaxed)}, certified by weak duality" + (" (the larger of the two lower bounds is kept)" if relaxed else ""))
    if exact:
        how.append(f"exact (assignment or Procrustes) over {', '.join(exact)}, which interact with no other "
                   "chosen space (no parameter carries two of them)")
    return JointBound(scope, tuple(chosen), fixed, lifted, True, "; ".join(how) + f": {what}" + note,
                      direct, min(bound, direct) if bound - direct <= noise else bound, whole, noise,
                      time.perf_counter() - t0, grams, max(value - improved, 0.0) if improved > noise else None)
