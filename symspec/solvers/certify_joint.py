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
solved when ``N <= JOINT_LIMIT`` and is otherwise "not available: too large" (the
residual with a layer's units, for one: O(d) and S(f) interact on every matrix between
them, N = d^2 + f^2).
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
#: SCS iterations at most (its inaccuracy loosens the certified bound, never breaks it)
SCS_ITERS = 1500

_EPS = float(torch.finfo(torch.float64).eps)


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

    @property
    def gap(self) -> float | None:
        return noisy_gap(self.value, self.bound, self.noise)

    def to_dict(self) -> dict[str, Any]:
        g = self.gap
        return {"scope": self.scope, "spaces": list(self.spaces), "fixed": list(self.fixed), "lifted_size": self.size,
                "available": self.available, "reason": self.reason, "value": self.value, "bound": self.bound,
                "gap": g, "relative_gap": None if g is None or not self.value else g / self.value,
                "whole_objective": self.whole, "seconds": round(self.seconds, 4)}


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

    def __attrs_post_init__(self) -> None:
        self.c = torch.zeros(self.n, dtype=torch.float64)

    def quadratic(self) -> torch.Tensor:
        if self.w is None:
            self.w = torch.zeros(self.n, self.n, dtype=torch.float64)
        return self.w

    def inner(self, x: torch.Tensor) -> float:
        assert self.c is not None
        quad = 0.0 if self.w is None else float(x @ self.w @ x)
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
                elements: Mapping[str, Element], variables: dict[str, _Var], params: list[str]) -> _Model | str:
    """The quadratic model of the objective over ``params`` (module), or why not."""
    total = sum(v.n * v.n for v in variables.values())
    model = _Model(total)
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
            for axis, seg in combo:
                spaces = [f.space for f in seg.factors]
                if any(s in variables for s in spaces):
                    if len(seg.factors) != 1:
                        return f"{p}: a variable space in a product of factors"
                    var_axes.append((axis, variables[spaces[0]], seg.factors[0]))
                    continue
                m = None
                for f in seg.factors:  # fixed: their matrices, factors[-1] acting first
                    g = problem.spaces[f.space].group
                    fm = g.matrix(elements[f.space], f.path, f.variance).double()  # type: ignore[arg-type]
                    m = fm if m is None else m @ fm
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
            model.k += float(ba.square().sum()) + float(bb.square().sum())
            _add_block(model, ba, bb, var_axes)
    return model


def _lin(model: _Model, v: _Var, a2: torch.Tensor, b2: torch.Tensor) -> None:
    """<a2, rho(M) b2> for a2, b2 [size, m]: its M-linear part into c, its E0 part into k0."""
    assert model.c is not None
    ua = torch.einsum("iku,im->kum", v.u, a2)
    ub = torch.einsum("ilu,im->lum", v.u, b2)
    model.c[v.offset : v.offset + v.n * v.n] += torch.einsum("kum,lum->kl", ua, ub).reshape(-1)
    if v.e0 is not None:
        model.k0 += float((a2 * (v.e0 @ b2)).sum())


def _add_block(model: _Model, ba: torch.Tensor, bb: torch.Tensor, var_axes: list[tuple[int, _Var, Any]]) -> None:
    if len(var_axes) == 1:
        axis, v, _ = var_axes[0]
        _lin(model, v, _axis_front(ba, [axis]), _axis_front(bb, [axis]))
        return
    w = model.quadratic()
    (ai, vi, _), (aj, vj, _) = var_axes
    a3, b3 = _axis_front(ba, [ai, aj]), _axis_front(bb, [ai, aj])  # [ni, nj, r]
    # the bilinear part: sum M_kl N_k'l' <A, U_k V_l^T B V'_l' U'_k'^T>
    at = torch.einsum("iku,ijr,jKv->kKuvr", vi.u, a3, vj.u)
    bt = torch.einsum("ilu,ijr,jLv->lLuvr", vi.u, b3, vj.u)
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
    prob = cp.Problem(cp.Maximize(cp.sum(cp.multiply(ctil, y))), cons)
    # SCS (first order): ~10x faster than Clarabel's interior point here, whose KKT
    # system is dense in the PSD cone's N^2/2 entries; its inaccuracy costs only
    # tightness, never validity (the bound is certified below)
    used = "SCS"
    with warnings.catch_warnings():  # "may be inaccurate": the certificate below accounts for it
        warnings.filterwarnings("ignore", message="Solution may be inaccurate")
        try:
            prob.solve(solver=cp.SCS, eps=1e-6, max_iters=SCS_ITERS)
        except cp.error.SolverError:
            used = "CLARABEL"
            prob.solve(solver=cp.CLARABEL)
    if cons[0].dual_value is None:
        raise RuntimeError(f"the SDP solver returned no multipliers ({prob.status})")
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


# -- components ----------------------------------------------------------------------------------

def components(problem: Problem, chosen: list[str]) -> list[tuple[tuple[str, ...], bool]]:
    """``chosen`` split into the groups of spaces that interact: two spaces interact when
    one parameter carries them on two of its axes (their blocks are bilinear in the two
    variables); a space on two axes of one parameter interacts with itself (quadratic).
    Per group: (its spaces, whether it interacts at all). The objective's inner part is
    a sum over the groups, each over its own variables, so its maximum is the sum of the
    groups' maxima; a group that does not interact is linear in its variable and is
    maximised exactly (:func:`linear_max`)."""
    import networkx as nx

    graph = nx.Graph()
    graph.add_nodes_from(chosen)
    quadratic: set[str] = set()
    for pb in problem.params.values():
        on_axes = [got for ab in pb.axes
                   if (got := {f.space for seg in ab.segments for f in seg.factors if f.space in graph})]
        if len(on_axes) < 2:
            continue
        seen: set[str] = set()
        for got in on_axes:
            quadratic |= got & seen
            seen |= got
        first = next(iter(seen))
        graph.add_edges_from((first, t) for t in seen if t != first)
    groups = sorted(([s for s in chosen if s in comp] for comp in nx.connected_components(graph)),
                    key=lambda m: chosen.index(m[0]))
    return [(tuple(m), len(m) > 1 or m[0] in quadratic) for m in groups]


def linear_max(model: _Model, v: _Var) -> float:
    """max over the variable's group of ``c^T vec(M)`` (a model with no quadratic part):
    the assignment's optimum for a permutation, the nuclear norm (the Procrustes value)
    for an orthogonal map; plus a margin for rounding (n^2 eps ||C||_F), so an upper bound."""
    assert model.c is not None
    c = model.c[v.offset : v.offset + v.n * v.n].reshape(v.n, v.n)
    if v.kind == "perm":
        from scipy.optimize import linear_sum_assignment  # type: ignore[import-untyped]

        rows, cols = linear_sum_assignment(c.numpy(), maximize=True)
        best = float(c[torch.as_tensor(rows), torch.as_tensor(cols)].sum())
    else:
        best = float(torch.linalg.svdvals(c).sum())
    return best + 4 * v.n * v.n * _EPS * float(torch.linalg.vector_norm(c))


# -- scopes --------------------------------------------------------------------------------------

def _coupled_sizes(problem: Problem, spaces: list[str], sizes: Mapping[str, int]) -> list[tuple[tuple[str, ...], int]]:
    """The interacting groups among ``spaces`` with their lifted sizes."""
    return [(m, sum(sizes[s] for s in m)) for m, coupled in components(problem, spaces) if coupled]


def _too_large(coupled: list[tuple[tuple[str, ...], int]], limit: int,
               supported: Mapping[str, tuple[str, int, torch.Tensor, torch.Tensor | None]]) -> str:
    big = [(m, n) for m, n in coupled if n > limit]
    return ("not available: too large (" + "; ".join(
        f"interacting spaces {', '.join(f'{s}: n={supported[s][1]}' for s in m)}: lifted size N = {n} > {limit}"
        for m, n in big) + ")")


def joint_bounds(problem: Problem, searched: Problem, canonical_a: Mapping[str, torch.Tensor],
                 canonical_b: Mapping[str, torch.Tensor], elements: Mapping[str, Element],
                 limit: int = JOINT_LIMIT) -> list[JointBound]:
    """The joint bound over every supported searched space when each group of
    interacting spaces fits the relaxation (lifted size at most ``limit``), else per
    layer (the spaces of one index, with the unindexed ones such as the residual when
    they fit); each scope's other spaces fixed at the result."""
    supported: dict[str, tuple[str, int, torch.Tensor, torch.Tensor | None]] = {}
    unsupported: list[str] = []
    for s, si in searched.spaces.items():
        g = si.group
        if g.is_trivial() or not problem.params_of(s):
            continue
        got = variable(g)
        if got is None or any(len(inc.segment.factors) > 1 for inc in problem.incidences(s)):
            unsupported.append(s)
        else:
            supported[s] = got
    note = ""
    if unsupported:
        kinds = sorted({str(searched.spaces[s].group) for s in unsupported})
        note = (f"; fixed at the result (not modelled by the relaxation: {', '.join(kinds[:3])}): "
                f"{', '.join(unsupported[:6])}" + (f" and {len(unsupported) - 6} more" if len(unsupported) > 6 else ""))
    if not supported:
        return [JointBound("all", (), tuple(unsupported), 0, False,
                           "not available: no searched space is a permutation, head permutation, O or OC" + note)]
    sizes = {s: v[1] ** 2 for s, v in supported.items()}

    def fits(spaces: list[str]) -> bool:
        return all(n <= limit for _, n in _coupled_sizes(problem, spaces, sizes))

    if fits(list(supported)):
        return [_scope(problem, canonical_a, canonical_b, elements, "all", list(supported), supported,
                       note, whole=not unsupported, limit=limit)]
    out = []
    layers = sorted({si.index for s, si in problem.spaces.items() if s in supported and si.index is not None})
    shared = [s for s in supported if problem.spaces[s].index is None]
    for i in layers:
        own = [s for s in supported if problem.spaces[s].index == i]
        chosen = own + shared if fits(own + shared) else own
        coupled = _coupled_sizes(problem, chosen, sizes)
        if any(n > limit for _, n in coupled):
            out.append(JointBound(f"layer {i}", tuple(chosen), (), sum(n for _, n in coupled), False,
                                  _too_large(coupled, limit, supported) + note))
            continue
        out.append(_scope(problem, canonical_a, canonical_b, elements, f"layer {i}", chosen, supported, note,
                          limit=limit))
    if not layers:
        coupled = _coupled_sizes(problem, list(supported), sizes)
        out.append(JointBound("all", tuple(supported), (), sum(n for _, n in coupled), False,
                              _too_large(coupled, limit, supported) + note))
    return out


def _scope(problem: Problem, a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor],
           elements: Mapping[str, Element], scope: str, chosen: list[str],
           supported: Mapping[str, tuple[str, int, torch.Tensor, torch.Tensor | None]], note: str,
           whole: bool = False, limit: int = JOINT_LIMIT) -> JointBound:
    """The bound over ``chosen`` (the others fixed): per group of interacting spaces
    (:func:`components`) the Shor relaxation, per space that interacts with none its
    exact maximum; the parameters no chosen space touches are constants."""
    t0 = time.perf_counter()
    fixed = tuple(s for s in problem.spaces if s not in chosen and not problem.spaces[s].group.is_trivial())
    params = [p for p, pb in problem.params.items() if whole or pb.spaces() & set(chosen)]
    eps = element_eps(elements)
    elems = {s: problem.spaces[s].group.to(e, dtype=torch.float64) for s, e in elements.items()}
    sizes = {s: supported[s][1] ** 2 for s in chosen}
    groups = components(problem, chosen)
    coupled_sizes = [(m, sum(sizes[s] for s in m)) for m, coupled in groups if coupled]
    lifted = sum(n for _, n in coupled_sizes)
    if any(n > limit for _, n in coupled_sizes):
        return JointBound(scope, tuple(chosen), fixed, lifted, False, _too_large(coupled_sizes, limit, supported) + note)
    value = bound = scale = 0.0
    covered: set[str] = set()
    solvers: set[str] = set()
    exact: list[str] = []
    relaxed: list[str] = []
    for members, coupled in groups:
        variables: dict[str, _Var] = {}
        offset = 0
        for s in members:
            kind, n, u, e0 = supported[s]
            variables[s] = _Var(s, kind, n, u, e0, offset)
            offset += n * n
        own = [p for p in params if problem.params[p].spaces() & set(members)]
        covered.update(own)
        model = build_model(problem, a, b, elems, variables, own)
        if isinstance(model, str):
            return JointBound(scope, tuple(chosen), fixed, lifted, False, f"not available: {model}" + note)
        x = torch.cat([_value_of(v, problem.spaces[s].group, elems[s]).reshape(-1) for s, v in variables.items()])
        if coupled:
            try:
                upper, used = solve_relaxation(model, list(variables.values()))
            except ImportError:
                return JointBound(scope, tuple(chosen), fixed, lifted, False, "not available: cvxpy is not installed" + note)
            solvers.add(used)
            relaxed.extend(members)
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
    if exact:
        how.append(f"exact (assignment or Procrustes) over {', '.join(exact)}, which interact with no other "
                   "chosen space (no parameter carries two of them)")
    return JointBound(scope, tuple(chosen), fixed, lifted, True, "; ".join(how) + f": {what}" + note,
                      direct, min(bound, direct) if bound - direct <= noise else bound, whole, noise,
                      time.perf_counter() - t0)
