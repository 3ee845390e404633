"""The Shor relaxation of a joint bound (see :mod:`.joint`): the lifted matrix
``Y = [1 x^T; x X] >= 0`` with the constraints every group element satisfies, solved by
:mod:`.sdp` and certified by weak duality from the solver's multipliers.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from scipy import sparse  # type: ignore[import-untyped]

from .model import Model, Var
from .sdp import solve_sdp, sym


def _constraints(variables: list[Var], size: int) -> tuple[Any, np.ndarray, Any]:
    """(A, b, Sel) over vec(Y), column-major, every row symmetrised (module)."""
    n1 = size + 1
    rows: list[dict[tuple[int, int], float]] = []
    rhs: list[float] = []

    def add(coef: dict[tuple[int, int], float], value: float) -> None:
        rows.append(coef)
        rhs.append(value)

    def idx(v: Var, k: int, lcol: int) -> int:
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



def solve_relaxation(model: Model, variables: list[Var]) -> tuple[float, str]:
    """(certified upper bound on max <C~, Y> over the relaxation, the solver used)."""
    import cvxpy as cp  # optional: the convex extra

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
    used = solve_sdp(cp.Problem(cp.Maximize(cp.sum(cp.multiply(ctil, y))), cons), cons[0], 1e-6)
    tmax = 1.0 + sum(v.n for v in variables)
    best = math.inf
    for sign in (1.0, -1.0):  # whichever sign convention the solver's multipliers follow
        yv = sign * np.asarray(cons[0].dual_value, dtype=np.float64).reshape(-1)
        smat = sym(amat.T @ yv, n1) - ctil
        if sel is not None:
            zv = np.clip(sign * np.asarray(cons[1].dual_value, dtype=np.float64).reshape(-1), 0.0, None)
            smat = smat - sym(sel.T @ zv, n1)
        lam = float(np.linalg.eigvalsh(0.5 * (smat + smat.T))[0])
        best = min(best, float(b @ yv) + max(0.0, -lam) * tmax)
    return best, used

