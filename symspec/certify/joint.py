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
from collections.abc import Mapping
from typing import Any

import attrs
import torch

from ..groups import Element
from ..problem import Problem
from ..transforms import apply_elements
from .components import components, gram_size, star_hub
from .gram import gram_relaxation
from .model import Var, build_model, linear_max, value_of, variable
from .sdp import SDPFailed
from .shor import solve_relaxation

#: the largest N = sum of the variables' squared sizes solved (the lifted matrix is N + 1
#: square); measured with SCS on 2 cores: N 41 in 0.2 s, 61 in 1 s, 100 in 1.5 s; 136
#: (two permutation spaces) in 22 s and 148 (one layer of a GPT, 12 units, 2 heads) in 40 s
JOINT_LIMIT = 100
#: the largest Gram relaxation solved (its PSD matrix is that square): 2 d plus one row per
#: vector a layer's spaces move against the residual, 512 for a layer of d = f = 64 with
#: 4 heads of 16; measured with SCS on 2 cores: 256 in 18 s, 512 in 100 s
GRAM_LIMIT = 600

_EPS = float(torch.finfo(torch.float64).eps)
#: what a bound that cvxpy solves says without it (the SDP relaxations, the doubly
#: stochastic one): each such bound is listed, with this, in the certificate
NEEDS_CVXPY = "not available: needs cvxpy (pip install 'symspec[convex]')"


def have_cvxpy() -> bool:
    """Whether cvxpy imports (an optional dependency: the ``convex`` extra)."""
    try:
        import cvxpy  # noqa: F401  # optional: the convex extra
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
    tally = _Tally()
    try:
        for members, coupled in groups:
            _add_group(tally, problem, a, b, elems, params, members, coupled, fit.get(members), supported)
    except _Unavailable as e:
        if e.needs_cvxpy:
            return JointBound(scope, tuple(chosen), fixed, lifted, False, f"{'; '.join(needed)}: {NEEDS_CVXPY}" + note,
                              needs_cvxpy=tuple(needed))
        return JointBound(scope, tuple(chosen), fixed, lifted, False, f"not available: {e}" + note)
    value, bound, scale = tally.value, tally.bound, tally.scale
    rest = [p for p in params if p not in tally.covered]
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
    moved = apply_elements(problem, elems, {p: b[p].double() for p in params})
    direct = sum(float((a[p].double() - moved[p]).square().sum()) for p in params)
    if abs(direct - value) > max(noise, 1e-9 * scale):
        return JointBound(scope, tuple(chosen), fixed, lifted, False,
                          f"not available: the model does not reproduce the objective ({value:.6g} vs {direct:.6g})" + note)
    bound = max(bound, 0.0)
    improved = tally.improved
    return JointBound(scope, tuple(chosen), fixed, lifted, True, _how(tally, whole) + note,
                      direct, min(bound, direct) if bound - direct <= noise else bound, whole, noise,
                      time.perf_counter() - t0, grams, max(value - improved, 0.0) if improved > noise else None)


class _Unavailable(Exception):
    """A group of spaces could not be bounded (the scope's bound is then not available);
    ``needs_cvxpy``: because a solver module of cvxpy does not import."""

    def __init__(self, reason: str, needs_cvxpy: bool = False) -> None:
        super().__init__(reason)
        self.needs_cvxpy = needs_cvxpy


@attrs.define
class _Tally:
    """A scope's sums over its groups of spaces, and how each group was bounded."""

    value: float = 0.0
    bound: float = 0.0
    scale: float = 0.0
    #: how much lower the rounded relaxations' elements are than the result
    improved: float = 0.0
    covered: set[str] = attrs.Factory(set)
    solvers: set[str] = attrs.Factory(set)
    exact: list[str] = attrs.Factory(list)
    relaxed: list[str] = attrs.Factory(list)
    gram_relaxed: list[str] = attrs.Factory(list)


def _add_group(tally: _Tally, problem: Problem, a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor],
               elems: Mapping[str, Element], params: list[str], members: tuple[str, ...], coupled: bool,
               f: _Fit | None, supported: Mapping[str, tuple[str, int, torch.Tensor, torch.Tensor | None]]) -> None:
    """Add one group of spaces (``members``; ``coupled``: they interact, relaxed as ``f``
    says, else one space maximised exactly) to the scope's sums; :class:`_Unavailable`
    where it cannot be bounded."""
    variables: dict[str, Var] = {}
    offset = 0
    for s in members:
        kind, n, u, e0 = supported[s]
        variables[s] = Var(s, kind, n, u, e0, offset)
        offset += n * n
    own = [p for p in params if problem.params[p].spaces() & set(members)]
    tally.covered.update(own)
    hub = variables[f.hub] if f is not None and f.gram_ok and f.hub is not None else None
    model = build_model(problem, a, b, elems, variables, own, dense=f is None or f.shor, hub=hub)
    if isinstance(model, str):
        raise _Unavailable(model)
    x = torch.cat([value_of(v, problem.spaces[s].group, elems[s]).reshape(-1) for s, v in variables.items()])
    if coupled:
        assert f is not None
        uppers = []
        try:
            if f.shor:
                upper, used = solve_relaxation(model, list(variables.values()))
                uppers.append(upper)
                tally.solvers.add(used)
                tally.relaxed.extend(members)
            if hub is not None:
                rounded: dict[str, Any] = {}
                upper, used = gram_relaxation(model, list(variables.values()), rounded)
                if "x" in rounded:  # an element the relaxation points at: better than the result?
                    tally.improved += max(0.0, model.value(x) - model.value(rounded["x"]))
                uppers.append(upper)
                tally.solvers.add(used)
                tally.gram_relaxed.extend(members)
        except ImportError as e:  # cvxpy imports, a solver module of it does not
            raise _Unavailable(str(e), needs_cvxpy=True) from e
        except SDPFailed as e:
            raise _Unavailable(str(e)) from e
        upper = min(uppers)
    else:
        (v,) = variables.values()
        upper = linear_max(model, v)
        tally.exact.append(members[0])
    tally.value += model.value(x)
    tally.bound += model.constant + model.k - 2 * (model.k0 + upper)
    tally.scale += model.k + model.constant


def _how(tally: _Tally, whole: bool) -> str:
    """How a scope's bound was found, and what it bounds."""
    what = ("a lower bound on the global minimum" if whole else "a lower bound on the minimum over these spaces, "
            "the others fixed at the result")
    how = []
    solvers = ", ".join(sorted(tally.solvers))
    if tally.relaxed:
        how.append(f"Shor SDP relaxation ({solvers}) over the interacting spaces "
                   f"{', '.join(tally.relaxed)}, certified by weak duality")
    if tally.gram_relaxed:
        how.append(f"Gram SDP relaxation ({solvers}) over the star-shaped interacting spaces "
                   f"{', '.join(tally.gram_relaxed)}, certified by weak duality"
                   + (" (the larger of the two lower bounds is kept)" if tally.relaxed else ""))
    if tally.exact:
        how.append(f"exact (assignment or Procrustes) over {', '.join(tally.exact)}, which interact with no other "
                   "chosen space (no parameter carries two of them)")
    return "; ".join(how) + f": {what}"
