"""The Gram relaxation of a joint bound over a star (see :mod:`.joint`): the Gram
matrix of the columns of ``[I, M, M V]``, solved by :mod:`.sdp` and certified by weak
duality; its solution rounded to a group element and improved by coordinate ascent
(:func:`star_descent`).
"""

from __future__ import annotations

import math
from typing import Any

import attrs
import numpy as np
import torch
from scipy import sparse  # type: ignore[import-untyped]

from .model import Model, Var, group_argmax, group_max
from .sdp import solve_sdp, sym

_EPS = float(torch.finfo(torch.float64).eps)


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
        def cat(parts: list[np.ndarray], dtype: Any) -> np.ndarray:
            return np.concatenate(parts).astype(dtype) if parts else np.zeros(0, dtype=dtype)

        ay = sparse.csr_matrix((cat(self.yv, np.float64), (cat(self.yr, np.int64), cat(self.yc, np.int64))),
                               shape=(self.n, self.size * self.size))
        ap = sparse.csr_matrix((cat(self.pv, np.float64), (cat(self.pr, np.int64), cat(self.pc, np.int64))),
                               shape=(self.n, self.np))
        return ay, ap, cat(self.b, np.float64)


def gram_relaxation(model: Model, variables: list[Var], rounded: dict[str, Any] | None = None) -> tuple[float, str]:
    """(certified upper bound on the inner part's maximum minus ``k0``, the solver used)
    for a star (``model.hub``, built with it): see the module docstring. ``rounded``: if
    given, receives ``x``, a group element (the model's variables) rounded from the
    relaxation's solution and improved by :func:`star_descent`."""
    import cvxpy as cp  # optional: the convex extra

    assert model.c is not None and model.hub is not None
    vo = model.hub
    perms = [v for v in variables if v is not vo]
    prog = _program(model, vo, perms)
    ay, ap, b = prog.rows.matrices()
    ctil = 0.5 * (prog.ctil + prog.ctil.T)
    y = cp.Variable((prog.size, prog.size), PSD=True)
    p = cp.Variable(prog.np, nonneg=True)
    eq = ay @ cp.vec(y, order="F") + ap @ p == b
    used = solve_sdp(cp.Problem(cp.Maximize(cp.sum(cp.multiply(ctil, y)) + prog.cp_obj @ p), [eq]), eq, 1e-7)
    birkhoff = [vo, *perms] if vo.kind == "perm" else perms  # p: the assignment's maximum over Birkhoff
    best = math.inf
    for sign in (1.0, -1.0):
        yv = sign * np.asarray(eq.dual_value, dtype=np.float64).reshape(-1)
        smat = sym(ay.T @ yv, prog.size) - ctil
        lam = float(np.linalg.eigvalsh(smat)[0])
        resid = prog.cp_obj - ap.T @ yv
        total = float(b @ yv) - prog.trace * lam
        total += prog.size * 8 * _EPS * float(np.linalg.norm(smat)) * prog.trace
        for v in birkhoff:
            rv = resid[prog.poff[v.space] : prog.poff[v.space] + v.n * v.n].reshape(v.n, v.n)
            total += group_max("perm", torch.as_tensor(rv))
        best = min(best, total)
    if rounded is not None and p.value is not None and y.value is not None:
        x = torch.zeros(model.n, dtype=torch.float64)
        pv = torch.as_tensor(np.asarray(p.value, dtype=np.float64))
        m = vo.n
        for v in [vo, *perms]:  # the nearest permutations and orthogonal map to the relaxed ones
            sol = (pv[prog.poff[v.space] : prog.poff[v.space] + v.n * v.n].reshape(v.n, v.n) if v.kind == "perm"
                   else torch.as_tensor(np.asarray(y.value, dtype=np.float64)[:m, m : 2 * m]))
            x[v.offset : v.offset + v.n * v.n] = group_argmax(v.kind, sol).reshape(-1)
        rounded["x"] = star_descent(model, variables, x)
    return best, used


@attrs.define
class _Program:
    """The Gram relaxation's program before cvxpy: its equality rows, the objective on Y
    (``ctil``, one triangle) and on p (``cp_obj``), the fixed trace of Y, where each
    permutation's entries start in p, and the sizes of Y and p."""

    rows: _Rows
    ctil: np.ndarray
    cp_obj: np.ndarray
    trace: float
    poff: dict[str, int]
    size: int
    np: int


def _stacks(model: Model, vo: Var) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Per leaf, its factors F, G [n, m, q] against the hub ``vo``, concatenated over its blocks."""
    stacks: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for o, v, f, g in model.factors:
        assert o is vo
        if v.space in stacks:
            f0, g0 = stacks[v.space]
            f, g = torch.cat([f0, f], -1), torch.cat([g0, g], -1)
        stacks[v.space] = (f, g)
    return stacks


def _program(model: Model, vo: Var, perms: list[Var]) -> _Program:
    """The program of the star with hub ``vo`` and leaves ``perms`` (module)."""
    assert model.c is not None
    m = vo.n
    stacks = _stacks(model, vo)
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
        n, p0 = v.n, poff[v.space]
        cp_obj[p0 : p0 + n * n] = model.c[v.offset : v.offset + n * n].numpy()
        pidx = p0 + ar(n)[:, None] * n + ar(n)[None, :]  # [K, L]
        r = rows.new(n, 1.0)  # row and column sums
        rows.p(r[:, None], pidx, 1.0)
        r = rows.new(n, 1.0)
        rows.p(r[:, None], pidx.T, 1.0)
        if v.space in stacks:
            f, g = (t.numpy() for t in stacks[v.space])  # [n, m, q]
            trace += _leaf_rows(rows, ctil, m, n, base[v.space], pidx, f, g)
    return _Program(rows, ctil, cp_obj, trace, poff, size, np_)


def _leaf_rows(rows: _Rows, ctil: np.ndarray, m: int, n: int, b0: int, pidx: np.ndarray, f: np.ndarray,
               g: np.ndarray) -> float:
    """A leaf's rows and objective on Y (its factors F, G [n, m, q] against the hub, its
    block of Z starting at column ``b0``, its entries ``pidx`` in p); its part of Y's trace."""
    ar = np.arange
    q = f.shape[-1]
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
    return float((g * g).sum())


def star_descent(model: Model, variables: list[Var], x: torch.Tensor, rounds: int = 20) -> torch.Tensor:
    """Coordinate ascent on a star's inner part from ``x``: the hub given the leaves
    (Procrustes or an assignment: linear in it), then every leaf given the hub (an
    assignment), until nothing improves; a group element whatever the start was."""
    assert model.c is not None and model.hub is not None
    hub = model.hub
    x = x.clone()

    def best(v: Var, c: torch.Tensor) -> None:
        x[v.offset : v.offset + v.n * v.n] = group_argmax(v.kind, c).reshape(-1)

    def part(v: Var) -> torch.Tensor:
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

