"""The quadratic model of the objective over the spaces a joint bound relaxes (see
:mod:`.joint`): each space's group as a matrix variable (:class:`Var`: permutations,
head permutations with trivial parts, O, OC), the objective ``F = K - 2 (k0 + c^T x +
x^T W x)`` over them (:class:`Model`, :func:`build_model`), and the exact maxima of a
linear function over one variable's group (:func:`group_max`, :func:`group_argmax`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import attrs
import torch
from scipy.optimize import linear_sum_assignment  # type: ignore[import-untyped]

from ..groups import Element, Group, Heads, NoEntry, centred_basis
from ..problem import Problem

_EPS = float(torch.finfo(torch.float64).eps)


# -- variables ---------------------------------------------------------------------------------

@attrs.frozen(eq=False)
class Var:
    """rho(M) = sum_kl M_kl U[:, k, :] V[:, l, :]^T + E0 for every path of the space."""

    space: str
    kind: str  # "perm" or "orth"
    n: int  # M is n x n
    u: torch.Tensor  # [size, n, w]
    e0: torch.Tensor | None  # [size, size]
    offset: int = 0


#: (variable kind "perm" or "orth", n, U, E0), see :class:`Var`
VarSpec = tuple[str, int, torch.Tensor, torch.Tensor | None]


def _permutation(group: Group) -> VarSpec | None:
    return "perm", group.n, torch.eye(group.n, dtype=torch.float64)[:, :, None], None


def _orthogonal(group: Group) -> VarSpec | None:
    return "orth", group.n, torch.eye(group.n, dtype=torch.float64)[:, :, None], None


def _centred(group: Group) -> VarSpec | None:
    """OC(n) as O(n - 1) in the zero-mean basis (OC(1) is trivial: not modelled)."""
    n = group.n
    if n == 1:
        return None
    return "orth", n - 1, centred_basis(n)[:, :, None], torch.full((n, n), 1.0 / n, dtype=torch.float64)


def _head_permutation(group: Group) -> VarSpec | None:
    """A head permutation, where every part is trivial, of one width, and no query heads share."""
    assert isinstance(group, Heads)
    if group.kv != group.heads or not all(g.is_trivial() for _, g in group.parts):
        return None
    dhs = {g.n for _, g in group.parts}
    if len(dhs) != 1:
        return None
    dh, h = dhs.pop(), group.heads
    u = torch.einsum("hk,ab->hakb", torch.eye(h, dtype=torch.float64), torch.eye(dh, dtype=torch.float64))
    return "perm", h, u.reshape(h * dh, h, dh), None


def _matrix_value(var: Var, group: Group, e: Element) -> torch.Tensor:
    m = group.matrix(e).double()
    if var.e0 is not None:  # OC: reduced
        b = var.u[:, :, 0]
        return b.T @ m @ b
    return m


def _head_permutation_value(var: Var, group: Group, e: Element) -> torch.Tensor:
    p = torch.zeros(var.n, var.n, dtype=torch.float64)
    p[torch.arange(var.n), e["perm"].long()] = 1.0
    return p


@attrs.frozen
class Relaxed:
    """How the relaxation models a group kind: its variable (None where this group of the
    kind is not modelled) and the variable's value at an element."""

    variable: Callable[[Group], VarSpec | None]
    value: Callable[[Var, Group, Element], torch.Tensor] = _matrix_value


_NOT_ORTHOGONAL = "not norm-preserving: the relaxation models orthogonal variables only"
#: group kind -> how the joint relaxation models a space of that kind (see :class:`Relaxed`);
#: a space whose kind has none is held fixed at the result and named
VARIABLES: dict[str, Relaxed | NoEntry] = {
    "S": Relaxed(_permutation),
    "O": Relaxed(_orthogonal),
    "OC": Relaxed(_centred),
    "Heads": Relaxed(_head_permutation, _head_permutation_value),
    "Experts": Relaxed(_head_permutation, _head_permutation_value),
    "SP": NoEntry("not modelled: signed permutations have no variable in the relaxation yet (held fixed)"),
    "Sign": NoEntry("not modelled: a global sign has no variable in the relaxation (held fixed)"),
    "Id": NoEntry("the trivial group is never searched: nothing to relax"),
    "GL": NoEntry(_NOT_ORTHOGONAL),
    "D": NoEntry(_NOT_ORTHOGONAL),
    "Dpos": NoEntry(_NOT_ORTHOGONAL),
    "RoPE": NoEntry(_NOT_ORTHOGONAL),
}


def variable(group: Group) -> VarSpec | None:
    """(kind, n, U, E0) of a searched group the relaxation models, else None."""
    entry = VARIABLES.get(group.kind)
    return entry.variable(group) if isinstance(entry, Relaxed) else None


def value_of(var: Var, group: Group, e: Element) -> torch.Tensor:
    """M at the result's element (in the spec's group ``group``)."""
    entry = VARIABLES[group.kind]
    assert isinstance(entry, Relaxed)
    return entry.value(var, group, e)


# -- the quadratic model -----------------------------------------------------------------------

@attrs.define
class Model:
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
    factors: list[tuple[Var, Var, torch.Tensor, torch.Tensor]] = attrs.Factory(list)
    #: the star's hub (:func:`star_hub`): blocks pairing it with another variable are kept as factors
    hub: Var | None = None

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
                elements: Mapping[str, Element], variables: dict[str, Var], params: list[str],
                dense: bool = True, hub: Var | None = None) -> Model | str:
    """The quadratic model of the objective over ``params`` (module), or why not;
    ``dense=False``: the star-shaped model of the Gram relaxation (:attr:`Model.factors`)."""
    total = sum(v.n * v.n for v in variables.values())
    model = Model(total, dense=dense, hub=hub)
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
            why = _add_param_block(problem, elements, variables, model, combo, ta[tuple(idx)], tb[tuple(idx)])
            if why is not None:
                return f"{p}: {why}"
    return model


def _fixed(problem: Problem, elements: Mapping[str, Element], factors: Any) -> torch.Tensor | None:
    """The matrix of a product of fixed factors (``factors[-1]`` acting first), or None
    for an empty product."""
    m = None
    for f in factors:
        g = problem.spaces[f.space].group
        fm = g.matrix(elements[f.space], f.path, f.variance).double()  # type: ignore[arg-type]
        m = fm if m is None else m @ fm
    return m


def _add_param_block(problem: Problem, elements: Mapping[str, Element], variables: dict[str, Var], model: Model,
                     combo: list[tuple[int, Any]], ba: torch.Tensor, bb: torch.Tensor) -> str | None:
    """Add one block of a parameter (one segment per bound axis: ``combo``; A's and B's
    entries ``ba``, ``bb``) to the model; or why it cannot be modelled."""
    var_axes: list[tuple[int, Var, Any]] = []
    #: fixed factors applied after a variable (g.B = L M R B): L per variable axis
    after: list[tuple[int, Var, torch.Tensor]] = []
    for axis, seg in combo:
        at = [i for i, f in enumerate(seg.factors) if f.space in variables]
        if len(at) > 1:
            return "two variable spaces in a product of factors"
        if at:
            (i,) = at
            f = seg.factors[i]
            right = _fixed(problem, elements, seg.factors[i + 1 :])
            if right is not None:  # acts before the variable: part of B
                bb = _apply_axis(right, bb, axis)
            left = _fixed(problem, elements, seg.factors[:i])
            var_axes.append((axis, variables[f.space], f))
            if left is not None:
                after.append((axis, variables[f.space], left))
            continue
        m = _fixed(problem, elements, seg.factors)
        if m is not None:
            bb = _apply_axis(m, bb, axis)
    if not var_axes:
        model.constant += float((ba - bb).square().sum())
        return None
    if len(var_axes) > 2:
        return "more than two variable axes"
    for _, v, f in var_axes:
        if f.variance == "abs" and v.kind != "perm":
            return "an abs factor of an orthogonal variable"
    model.k += float(ba.square().sum())
    got = _apply_after(model, ba, bb, after)
    if isinstance(got, str):
        return got
    ba, b_norm = got
    model.k += b_norm
    return _add_block(model, ba, bb, var_axes)


def _apply_after(model: Model, ba: torch.Tensor, bb: torch.Tensor,
                 after: list[tuple[int, Var, torch.Tensor]]) -> tuple[torch.Tensor, float] | str:
    """The fixed factors ``L`` applied after a variable moved onto A (``<A, L M B'> =
    <L^T A, M B'>``): (A's block, the norm ||L M B'||^2 where it is a constant), or why
    not; a diagonal L under a permutation adds its norm's linear part to the model."""
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
            return (f"{v.space} ({v.kind}) under a fixed factor that is not orthogonal "
                    "(only a permutation under a fixed diagonal one is modelled)")
        # ||L M B'||^2 = sum_kl M_kl w_kl: linear in a permutation (the other axis, if
        # variable, is orthogonal and does not change it); F gets it through -2 inner
        nb = _axis_front(bb, [axis]).square().sum(-1)
        w = torch.einsum("ika,i,jla,j->kl", v.u, torch.diagonal(gram), v.u, nb)
        assert model.c is not None
        model.c[v.offset : v.offset + v.n * v.n] -= 0.5 * w.reshape(-1)
        b_norm = 0.0
    return ba, b_norm


def _lin(model: Model, v: Var, a2: torch.Tensor, b2: torch.Tensor) -> None:
    """<a2, rho(M) b2> for a2, b2 [size, m]: its M-linear part into c, its E0 part into k0."""
    assert model.c is not None
    ua = torch.einsum("iku,im->kum", v.u, a2)
    ub = torch.einsum("ilu,im->lum", v.u, b2)
    model.c[v.offset : v.offset + v.n * v.n] += torch.einsum("kum,lum->kl", ua, ub).reshape(-1)
    if v.e0 is not None:
        model.k0 += float((a2 * (v.e0 @ b2)).sum())


def _add_block(model: Model, ba: torch.Tensor, bb: torch.Tensor, var_axes: list[tuple[int, Var, Any]]) -> str | None:
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


def linear_max(model: Model, v: Var) -> float:
    """max over the variable's group of ``c^T vec(M)`` (a model with no quadratic part):
    see :func:`group_max`."""
    assert model.c is not None
    return group_max(v.kind, model.c[v.offset : v.offset + v.n * v.n].reshape(v.n, v.n))


def group_max(kind: str, c: torch.Tensor) -> float:
    """max of ``<c, M>`` over the permutations (``kind`` "perm": the assignment's optimum)
    or the orthogonal maps (the nuclear norm: the Procrustes value); plus a margin for
    rounding (n^2 eps ||C||_F), so an upper bound."""
    n = c.shape[0]
    if kind == "perm":
        rows, cols = linear_sum_assignment(c.cpu().numpy(), maximize=True)
        best = float(c[torch.as_tensor(rows), torch.as_tensor(cols)].sum())
    else:
        best = float(torch.linalg.svdvals(c).sum())
    return best + 4 * n * n * _EPS * float(torch.linalg.vector_norm(c))


def group_argmax(kind: str, c: torch.Tensor) -> torch.Tensor:
    """The element M maximising ``<c, M>``: a permutation matrix (the assignment) for
    ``kind`` "perm", else the orthogonal polar factor U V^T."""
    if kind == "perm":
        rows, cols = linear_sum_assignment(c.cpu().numpy(), maximize=True)
        m = torch.zeros_like(c)
        m[torch.as_tensor(rows), torch.as_tensor(cols)] = 1.0
        return m
    u, _, vh = torch.linalg.svd(c)
    return u @ vh
