"""The fitted lift: the Stiefel map, the unit and head copies, their shares and scales
chosen to bring the lifted B closest to A, instead of drawn at random.

Each round:

1. lift B with the current maps and align it to A (weight matching; with data,
   activation matching); the residual's orthogonal element Q composes with the Stiefel
   map (Q U is the fitted Stiefel map: any Stiefel map is Q U for some Q, so this is a
   Procrustes fit of U itself: on the weights, or on the cross-covariance of the
   residual activations);
2. for every unit space, B's units are written in A's frame (every other space lifted
   with the fitted maps, this one left narrow) and each of A's units is given a B unit,
   every B unit at least once, at the least total squared distance (:mod:`.assign`, an
   exact semi-permutation matching) of the incoming weights, or with data of the
   hidden-unit activations (E||x_A,k - x_B,j||^2 from their cross-covariance); where a
   scaling acts with the units (a gated unit's up path, ReLU units), the distance is
   the least over the copy's scale, and the scale is kept in the lift (``D``/``Dpos``
   spaces lift to that diagonal). The shares of a unit's copies fit A's outgoing
   weights in least squares over the simplex (the exact solution: a projection onto the
   simplex; hidden activations do not see the shares, so they come from the weights in
   both cases). Key/value heads are assigned on their QK circuits (unchanged by the
   per-head maps) and shared on their OV circuits;
3. B is lifted again with these maps (later rounds align with the units fixed: they are
   fitted exactly in step 2).

Last, the lifted B is aligned to A with the units fixed and that element applied (a
lift followed by a group element of A is a lift): the heads' permutations and per-head
maps and the residual are in place before the caller's alignment starts, which then
keeps them unless it finds better. On a planted pair (A = g.lift(B) for a random lift and
a random group element g) this recovers A exactly (tests/test_width.py), which a random
lift cannot.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import attrs
import torch

from ..alignment import align
from ..alignment.activation import ActivationOptions
from ..alignment.moments import collect_moments
from ..binding import bind
from ..groups import NoEntry
from ..problem import take_segment
from ..solvers.engine.activation_statistics import activation_problem
from ..spec.model import Spec
from .assign import semiperm_assignment
from .lifting import (
    LiftError,
    LiftResult,
    SpaceLift,
    _action,
    canonical_f64,
    check_lift,
    lift,
    lift_tensor,
)


def project_simplex(t: torch.Tensor) -> torch.Tensor:
    """The Euclidean projection of a vector onto the probability simplex."""
    u, _ = torch.sort(t, descending=True)
    css = torch.cumsum(u, 0) - 1
    k = torch.arange(1, t.numel() + 1, dtype=t.dtype)
    rho = int((u - css / k > 0).nonzero().max())
    theta = css[rho] / (rho + 1)
    return (t - theta).clamp_min(0)


def _scaled_cost(a: torch.Tensor, b: torch.Tensor, positive: bool) -> torch.Tensor:
    """[n_A, n_B]: min over the scale s of ||a_k - s b_j||^2 (s > 0 when ``positive``),
    float64, never below zero (the closed form |a|^2 - <a, b>^2 / |b|^2 cancels)."""
    ab = a @ b.T
    bb = (b * b).sum(1)
    num = ab.clamp_min(0) if positive else ab
    explained = torch.where(bb > 0, num.square() / torch.where(bb > 0, bb, 1.0), 0.0)
    return ((a * a).sum(1)[:, None] - explained).clamp_min(0)


def assign_copies(a: UnitVectors, b: UnitVectors) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """(owner [n_A]: the B unit each of A's units copies, every B unit at least once;
    scale [n_A] or None: the scale of each copy's scaled part) at the least total squared
    distance of the unit vectors (the scaled part at its best scale), by the exact
    semi-permutation matching. None: nothing to fit the copies on."""
    cost: torch.Tensor | None = None
    if a.inc is not None and b.inc is not None:
        cost = torch.cdist(a.inc, b.inc).square()
    if a.sinc is not None and b.sinc is not None:
        part = _scaled_cost(a.sinc, b.sinc, a.positive)
        cost = part if cost is None else cost + part
    if cost is None:
        return None
    owner = semiperm_assignment(cost, "exact").owner
    if a.sinc is None or b.sinc is None:
        return owner, None
    bs = b.sinc[owner]
    bb = (bs * bs).sum(1)
    scale = (a.sinc * bs).sum(1) / torch.where(bb > 0, bb, 1.0)  # A's scaled part = scale x B's
    usable = (bb > 0) & torch.isfinite(scale) & ((scale > 0) if a.positive else (scale != 0))
    return owner, torch.where(usable, scale, torch.ones_like(scale))


def fit_shares(owner: torch.Tensor, scale: torch.Tensor | None, a: UnitVectors, b: UnitVectors, nb: int) -> torch.Tensor:
    """The semi-permutation T (n_A x n_B) with the given copies whose shares fit A's
    outgoing weights (those a scaling acts on taken at the copy's scale) in least squares
    over the simplex, per B unit (equal shares where B's unit writes nothing)."""
    na = owner.shape[0]
    a_parts, b_parts = [], []
    if a.out is not None and b.out is not None:
        a_parts.append(a.out)
        b_parts.append(b.out)
    if a.sout is not None and b.sout is not None:
        a_parts.append(a.sout * (scale[:, None] if scale is not None else 1.0))  # A's = share / scale x B's
        b_parts.append(b.sout)
    a_out = torch.cat(a_parts, 1) if a_parts else None
    b_out = torch.cat(b_parts, 1) if b_parts else None
    t = torch.zeros(na, nb, dtype=torch.float64)
    for j in range(nb):
        copies = (owner == j).nonzero().flatten()
        w = b_out[j] if b_out is not None else None
        ww = float(w @ w) if w is not None else 0.0
        if ww == 0.0 or a_out is None:
            shares = torch.full((len(copies),), 1.0 / len(copies), dtype=torch.float64)
        else:
            shares = project_simplex(a_out[copies] @ w / ww)
            if shares.sum() <= 0 or (shares <= 0).any():  # a copy must keep a positive share
                shares = 0.999 * shares + 0.001 / len(copies)
                shares = shares / shares.sum()
        t[copies, j] = shares
    return t


def fit_units(a: UnitVectors, b: UnitVectors) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """(T, scale): the semi-permutation (n_A x n_B: rows A's units, columns B's) and the
    per-copy scales (None where no scaling acts) that best lift B's units onto A's (see
    the module); None when there is nothing to fit the copies on."""
    copies = assign_copies(a, b)
    if copies is None:
        return None
    owner, scale = copies
    nb = (b.inc if b.inc is not None else b.sinc).shape[0]  # type: ignore[union-attr]
    return fit_shares(owner, scale, a, b, nb), scale


@attrs.define
class UnitVectors:
    """Per unit of a space (one row each), flattened: ``inc`` its incoming weights where
    the space acts alone, ``out`` its outgoing weights where it acts alone, ``sinc`` and
    ``sout`` the same where a scaling acts with it (a gated unit's up path and the layer
    that reads it; ``partner``: that scaling's space, ``positive``: a Dpos one)."""

    inc: torch.Tensor | None
    out: torch.Tensor | None
    sinc: torch.Tensor | None
    sout: torch.Tensor | None
    partner: str | None = None
    positive: bool = False


def _unit_vectors(problem: Any, sd: Mapping[str, torch.Tensor], space: str,
                  rows: torch.Tensor | None = None) -> UnitVectors:
    """The unit vectors of ``space`` from the bound tensors ``sd`` (weights, or the
    factored activation sites); ``rows``: keep these units only."""
    found: dict[str, list[torch.Tensor]] = {"inc": [], "out": [], "sinc": [], "sout": []}
    partner = None
    for name, b in problem.params.items():
        for ab in b.axes:
            if ab.layout is not None or len(ab.segments) != 1 or name not in sd:
                continue
            facs = ab.segments[0].factors
            if not facs or facs[0].space != space or len(facs) > 2:
                continue
            t = sd[name].movedim(ab.axis, 0).reshape(sd[name].shape[ab.axis], -1).double()
            if rows is not None:
                t = t[rows]
            key = ("out" if facs[0].variance == "contra" else "inc") if len(facs) == 1 else \
                ("sout" if facs[0].variance == "contra" else "sinc")
            if len(facs) == 2:
                partner = facs[1].space
            found[key].append(t)
    positive = partner is not None and FITS.get(problem.spaces[partner].group.kind) == "positive scaling"
    return UnitVectors(**{k: (torch.cat(v, 1) if v else None) for k, v in found.items()}, partner=partner,
                       positive=positive)


def _head_circuits(problem: Any, sd: Mapping[str, torch.Tensor], space: str, heads: Any) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Per key/value head of ``space``: its QK circuit (sum over its query heads of
    W_q^T W_k, on the residual) and OV circuit (sum of W_o W_v), flattened. Both are
    unchanged by the per-head GL maps and by the order of query heads inside a group, so
    heads of A and of B compare on them; a copy of a head has the same QK circuit and a
    share of its OV circuit."""
    k, g = heads.kv, heads.group_size
    sides: dict[str, list[torch.Tensor]] = {"q": [], "k": [], "v": [], "o": []}
    for name, b in problem.params.items():
        if len(b.shape) != 2:
            continue
        for ab in b.axes:
            for seg in ab.segments:
                if len(seg.factors) != 1 or seg.factors[0].space != space:
                    continue
                f = seg.factors[0]
                part = f.path[0] if f.path and f.path[0] != "kv" else ""
                kv = bool(f.path) and f.path[-1] == "kv"
                rows = take_segment(sd[name].double().movedim(ab.axis, 0), seg, ab.layout)
                side = {("qk", "co"): "q", ("qk", "contra"): "k", ("ov", "co"): "v", ("ov", "contra"): "o"}.get((part, f.variance))
                if side is not None:
                    sides[side].append(rows.reshape(k if kv else k * g, -1, rows.shape[-1]))
    if not all(sides.values()):
        return None
    q, kk, v, o = (sides[s][0] for s in ("q", "k", "v", "o"))
    if kk.shape[0] != k:  # keys in the query-head view: one per query head
        kk = kk.reshape(k, g, *kk.shape[1:])[:, 0]
    if v.shape[0] != k:
        v = v.reshape(k, g, *v.shape[1:])[:, 0]
    qg = q.reshape(k, g, *q.shape[1:])
    og = o.reshape(k, g, *o.shape[1:])
    qk = torch.einsum("kgad,kae->kde", qg, kk).reshape(k, -1)
    ov = torch.einsum("kgae,kad->kde", og, v).reshape(k, -1)
    return qk, ov


def fit_heads(a: tuple[torch.Tensor, torch.Tensor], b: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """The semi-permutation of key/value heads (A's rows, B's columns) that best lifts B's
    heads onto A's: copies by the nearest QK circuit, shares from the OV circuits."""
    fitted = fit_units(UnitVectors(a[0], a[1], None, None), UnitVectors(b[0], b[1], None, None))
    assert fitted is not None
    return fitted[0]


_NO_LIFT = "no lift of its width (see lifting.LIFTS): nothing to fit"
#: group kind -> what the fitted lift fits in a space of that kind: the copies of "units"
#: (assigned to A's units, their shares fitted), the scale of a "scaling" or "positive
#: scaling" beside them, a "stiefel" residual map (from the matched element), the key/value
#: copies of "heads"; the unit and scaling spaces are held fixed while the rest is matched
FITS: dict[str, str | NoEntry] = {
    "S": "units",
    "SP": "units",
    "D": "scaling",
    "Dpos": "positive scaling",
    "O": "stiefel",
    "OC": "stiefel",
    "GL": "stiefel",
    "Heads": "heads",
    "Sign": NoEntry("a global sign beside the units keeps any width: nothing to fit"),
    "Id": NoEntry(_NO_LIFT),
    "RoPE": NoEntry(_NO_LIFT),
    "Experts": NoEntry(_NO_LIFT),
}


def fitted_lift(narrow: torch.nn.Module, wide: torch.nn.Module, spec: Spec, *, seed: int = 0, rounds: int = 2,
                inputs: Any = None, data: Any = None, batches: int | None = 32,
                progress: Callable[[str], None] | None = None) -> LiftResult:
    """B lifted into A's shape with the maps fitted to A (see the module): on the weights
    (weight matching's objective), or with ``data`` (evaluation data: ``batches``, a list
    of ``(inputs, targets)``; at most ``batches`` of them are read) on the activations
    (activation matching's): the residual map from the residual sites' cross-covariance,
    the unit copies and scales from the hidden units'. ``inputs``: checked as
    :func:`~.lifting.lift` does."""
    say = progress or (lambda msg: None)
    ba, bb = bind(spec, wide), bind(spec, narrow)
    canon_a, canon_b = _as_bound(ba.problem, canonical_f64(ba, wide)), canonical_f64(bb, narrow)
    method = "weight" if data is None else "activation"
    tuning = None if data is None else ActivationOptions(batches=batches)
    units = {n for n, si in ba.problem.spaces.items() if FITS.get(si.group.kind) in ("units", "scaling", "positive scaling")}
    held = {ba.problem.spaces[n].decl: "fixed" for n in units}
    # activations run in A's module: B's lift takes A's dtype there (a traced model checks it)
    work = torch.float64 if data is None else next(iter(wide.parameters())).dtype
    current = lift(narrow, wide, spec, seed=seed, dtype=work)
    fixed: dict[str, dict[str, Any]] = {}
    for r in range(rounds):
        say(f"fitting the lift ({method}): round {r + 1}/{rounds}")
        # the first round's units are drawn: they are searched with the rest
        res = align(wide, current.model, spec, method=method, data=data, options=tuning,
                    groups=held if r and held else None)
        for name, sl in current.lifts.items():
            group = res.bound.problem.spaces[name].group
            e = res.elements.get(name)
            if e is None or FITS.get(group.kind) != "stiefel" or sl.kind not in ("stiefel", "identity"):
                continue
            q = e["matrix"].double()
            base = sl.write / sl.detail["scale"] if sl.kind == "stiefel" else torch.eye(sl.narrow, dtype=torch.float64)
            fixed[name] = {"stiefel_map": q @ base}
        # the unit and head copies, in the frame of the fitted residual
        partial = lift(narrow, wide, spec, seed=seed, fixed=_without_scales(fixed), dtype=work)
        sites = _site_vectors(res, partial, data, batches) if data is not None else None
        for name, sl in partial.lifts.items():
            if sl.kind == "heads" and sl.detail["kv"].shape[0] != sl.detail["kv"].shape[1]:
                narrow_sd = _lift_all_but(bb.problem, canon_b, partial, name)
                hb = _head_circuits(bb.problem, narrow_sd, name, bb.problem.spaces[name].group)
                ha = _head_circuits(ba.problem, canon_a, name, ba.problem.spaces[name].group)
                if ha is not None and hb is not None:
                    fixed.setdefault(name, {})["kv_semiperm"] = fit_heads(ha, hb)
                continue
            if sl.kind != "semiperm" or FITS.get(ba.problem.spaces[name].group.kind) != "units":
                continue
            narrow_sd = _lift_all_but(bb.problem, canon_b, partial, name)
            bv = _unit_vectors(bb.problem, narrow_sd, name)
            av = _unit_vectors(ba.problem, canon_a, name)
            copies = sites(name, sl) if sites is not None else assign_copies(av, bv)
            if copies is None:
                continue  # nothing to fit the copies on: they stay as drawn
            owner, scale = copies
            fixed.setdefault(name, {})["semiperm"] = fit_shares(owner, scale, av, bv, sl.narrow)
            if scale is not None and av.partner is not None:
                fixed[av.partner] = {"scale": scale}
        current = lift(narrow, wide, spec, seed=seed, fixed=fixed, dtype=work)
    # the heads and the residual brought in place, the fitted units kept
    res = align(wide, current.model, spec, method=method, data=data, options=tuning, groups=held or None)
    model = res.canonical_model
    assert model is not None
    model.load_state_dict({k: v.to(torch.float64) for k, v in res.aligned_b.items()}, strict=False)
    model.eval()
    error = None
    if inputs is not None:
        error = check_lift(narrow, model, inputs, outputs=ba.problem.outputs)
        if not error <= 1e-9:
            raise LiftError(f"the fitted lift does not compute what the narrow one does (max rel err {error:.2e} in float64)")
    model.to(next(iter(narrow.parameters())).dtype)
    lifts = dict(current.lifts)
    return LiftResult(model, lifts, bind(spec, model), error)


def _without_scales(fixed: Mapping[str, Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """The fitted maps without the scalings (pure copies, whose activations are B's)."""
    return {n: dict(kw) for n, kw in fixed.items() if "scale" not in kw}


def _site_vectors(res: Any, partial: LiftResult, data: Any,
                  batches: int | None) -> Callable[[str, SpaceLift], tuple[torch.Tensor, torch.Tensor | None] | None]:
    """With data: the copies of each unit space from the hidden-unit activations. A and
    ``partial`` (B lifted with pure copies: a copy's activations are its B unit's) run
    over the data in A's module; the moments of every site are factored into bound
    tensors (``L_A L_B^T = C``, ``L_B L_B^T = G``, rows comparable across the models:
    ||L_A,k - L_B,j||^2 = E||x_A,k - x_B,j||^2 up to a constant per k), and B's units
    are read at the first copy of each."""
    problem = res.bound.problem
    module = res.canonical_model
    dtype = next(iter(module.parameters())).dtype
    sd_b = {k: v.to(dtype) for k, v in canonical_f64(partial.bound, partial.model).items()}
    moments = collect_moments(module, problem, {k: v.to(dtype) for k, v in res.canonical_a.items()},
                              sd_b, data, batches=batches)
    prob, la, lb = activation_problem(problem, moments, normalize="none", dtype=torch.float64)

    def copies(name: str, sl: SpaceLift) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        assert sl.write is not None
        first = sl.write.argmax(0)  # one copy of each B unit
        av = _unit_vectors(prob, la, name)
        bv = _unit_vectors(prob, lb, name, rows=first)
        return assign_copies(av, bv)

    return copies


def _lift_all_but(problem_b: Any, canonical_b: Mapping[str, torch.Tensor], lifted: LiftResult,
                  keep: str) -> dict[str, torch.Tensor]:
    """B's canonical weights with every space lifted by ``lifted``'s maps except ``keep``
    (left at B's width) and the scalings (the identity): B's units of that space, written
    in A's frame, as the bindings see them (a view's merged axes stay merged)."""
    def narrow(sl: SpaceLift) -> SpaceLift:
        return SpaceLift(sl.space, "identity", sl.narrow, sl.narrow)

    actions = {n: _action(narrow(sl) if n == keep or sl.kind == "scale" else sl) for n, sl in lifted.lifts.items()}
    return {k: lift_tensor(b, b, canonical_b[k], actions, store=False) for k, b in problem_b.params.items()
            if k in canonical_b}


def unit_costs(problem_a: Any, canonical_a: Mapping[str, torch.Tensor], problem_b: Any,
               canonical_b: Mapping[str, torch.Tensor], lifted: LiftResult, space: str) -> torch.Tensor:
    """What matching A's units of ``space`` with B's costs, as the fitted lift sees them:
    squared distances between their incoming vectors (``[units of A, units of B]``), B's
    written in A's frame by ``lifted``'s maps on every other space (the semi-permutation
    benchmark's trained problems)."""
    a = _unit_vectors(problem_a, canonical_a, space)
    b = _unit_vectors(problem_b, _lift_all_but(problem_b, canonical_b, lifted, space), space)
    return torch.cdist(a.inc, b.inc) ** 2


def _as_bound(problem: Any, sd: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Each parameter as its axis bindings see it (a fused expert weight through its view),
    as :func:`_lift_all_but` gives B's: what the unit vectors and head circuits read."""
    return {k: problem.params[k].viewed(v) if k in problem.params else v for k, v in sd.items()}
