"""The fitted lift: the Stiefel map and the unit copies chosen to bring the lifted B
closest to A, instead of drawn at random.

Each round:

1. lift B with the current maps and align it to A by weight matching; the residual's
   orthogonal element Q composes with the Stiefel map (Q U is the fitted Stiefel map:
   any Stiefel map is Q U for some Q, so this is a Procrustes fit of U itself), and the
   head permutation is kept;
2. for every unit space, B's units are written in A's frame (every other space lifted
   with the fitted maps, this one left narrow) and each of A's units is given a B unit,
   every B unit at least once, at the least total squared distance of incoming weights
   (:mod:`.assign`, an exact semi-permutation matching); the shares of a unit's copies fit A's outgoing weights in least squares over the
   simplex (the exact solution: a projection onto the simplex);
3. B is lifted again with these maps.

Weight matching then runs as usual on the fitted lift. On a planted pair (A = g.lift(B)
for a random lift and a random group element g) this recovers A exactly
(tests/test_width.py), which a random lift cannot.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import attrs
import torch

from ..binding import bind
from ..groups import OC, SP, O, S
from ..groups.classic import GL
from ..spec.model import Spec
from .assign import semiperm_assignment
from .lifting import LiftResult, SpaceLift, _action, canonical_f64, lift, lift_tensor


def project_simplex(t: torch.Tensor) -> torch.Tensor:
    """The Euclidean projection of a vector onto the probability simplex."""
    u, _ = torch.sort(t, descending=True)
    css = torch.cumsum(u, 0) - 1
    k = torch.arange(1, t.numel() + 1, dtype=t.dtype)
    rho = int((u - css / k > 0).nonzero().max())
    theta = css[rho] / (rho + 1)
    return (t - theta).clamp_min(0)


def fit_units(a: UnitVectors, b: UnitVectors) -> torch.Tensor:
    """The semi-permutation T (n_A x n_B) that best lifts B's units onto A's (rows: A's
    units, columns: B's): the copies minimise the total squared distance of incoming
    weights with every B unit copied at least once (:mod:`.assign`, exact); the shares fit A's outgoing weights, after the
    per-copy scaling that the scaled incoming weights show (a gated unit's up path) is
    taken out."""
    assert a.inc is not None and b.inc is not None
    na, nb = a.inc.shape[0], b.inc.shape[0]
    owner = semiperm_assignment(torch.cdist(a.inc, b.inc) ** 2, "exact").owner
    # what each of A's units writes back, and each of B's, for the shares
    if a.out is not None and b.out is not None:
        a_out, b_out = a.out, b.out
    elif a.sout is not None and b.sout is not None and a.sinc is not None and b.sinc is not None:
        bs = b.sinc[owner]
        scale = (a.sinc * bs).sum(1) / (bs * bs).sum(1).clamp_min(1e-300)  # A's up path = scale x B's
        a_out, b_out = a.sout * scale[:, None], b.sout
    else:
        a_out = b_out = None
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


@attrs.define
class UnitVectors:
    """Per unit of a space (one row each), flattened: ``inc`` its incoming weights where
    the space acts alone, ``out`` its outgoing weights where it acts alone, ``sinc`` and
    ``sout`` the same where a scaling acts with it (a gated unit's up path and the layer
    that reads it)."""

    inc: torch.Tensor | None
    out: torch.Tensor | None
    sinc: torch.Tensor | None
    sout: torch.Tensor | None


def _unit_vectors(problem: Any, sd: Mapping[str, torch.Tensor], space: str) -> UnitVectors:
    found: dict[str, list[torch.Tensor]] = {"inc": [], "out": [], "sinc": [], "sout": []}
    for name, b in problem.params.items():
        for ab in b.axes:
            if ab.layout is not None or len(ab.segments) != 1:
                continue
            facs = ab.segments[0].factors
            if not facs or facs[0].space != space or len(facs) > 2:
                continue
            rows = sd[name].movedim(ab.axis, 0).reshape(sd[name].shape[ab.axis], -1).double()
            key = ("out" if facs[0].variance == "contra" else "inc") if len(facs) == 1 else \
                ("sout" if facs[0].variance == "contra" else "sinc")
            found[key].append(rows)
    return UnitVectors(**{k: (torch.cat(v, 1) if v else None) for k, v in found.items()})


def _head_circuits(problem: Any, sd: Mapping[str, torch.Tensor], space: str, heads: Any) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Per key/value head of ``space``: its QK circuit (sum over its query heads of
    W_q^T W_k, on the residual) and OV circuit (sum of W_o W_v), flattened. Both are
    unchanged by the per-head GL maps and by the order of query heads inside a group, so
    heads of A and of B compare on them; a copy of a head has the same QK circuit and a
    share of its OV circuit."""
    from ..problem import take_segment

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
    return fit_units(UnitVectors(a[0], a[1], None, None), UnitVectors(b[0], b[1], None, None))


def fitted_lift(narrow: torch.nn.Module, wide: torch.nn.Module, spec: Spec, *, seed: int = 0, rounds: int = 2,
                inputs: Any = None, progress: Callable[[str], None] | None = None) -> LiftResult:
    """B lifted into A's shape with the maps fitted to A (see the module)."""
    from ..alignment import align

    say = progress or (lambda msg: None)
    ba, bb = bind(spec, wide), bind(spec, narrow)
    canon_a, canon_b = canonical_f64(ba, wide), canonical_f64(bb, narrow)
    current = lift(narrow, wide, spec, seed=seed, dtype=torch.float64)
    fixed: dict[str, dict[str, Any]] = {}
    for r in range(rounds):
        say(f"fitting the lift: round {r + 1}/{rounds}")
        res = align(wide, current.model, spec, method="weight")
        for name, sl in current.lifts.items():
            group = res.bound.problem.spaces[name].group
            e = res.elements.get(name)
            if e is None or not isinstance(group, (O, OC, GL)) or sl.kind not in ("stiefel", "identity"):
                continue
            q = e["matrix"].double()
            base = sl.write / sl.detail["scale"] if sl.kind == "stiefel" else torch.eye(sl.narrow, dtype=torch.float64)
            fixed[name] = {"stiefel_map": q @ base}
        # the unit and head copies, in the frame of the fitted residual
        partial = lift(narrow, wide, spec, seed=seed, fixed=fixed, dtype=torch.float64)
        for name, sl in partial.lifts.items():
            if sl.kind == "heads" and sl.detail["kv"].shape[0] != sl.detail["kv"].shape[1]:
                narrow_sd = _lift_all_but(bb.problem, canon_b, partial, name)
                hb = _head_circuits(bb.problem, narrow_sd, name, bb.problem.spaces[name].group)
                ha = _head_circuits(ba.problem, canon_a, name, ba.problem.spaces[name].group)
                if ha is not None and hb is not None:
                    fixed.setdefault(name, {})["kv_semiperm"] = fit_heads(ha, hb)
                continue
            if sl.kind != "semiperm" or not isinstance(ba.problem.spaces[name].group, (S, SP)):
                continue
            narrow_sd = _lift_all_but(bb.problem, canon_b, partial, name)
            bv = _unit_vectors(bb.problem, narrow_sd, name)
            av = _unit_vectors(ba.problem, canon_a, name)
            if av.inc is None or bv.inc is None:
                continue  # nothing to fit the copies on: they stay as drawn
            fixed.setdefault(name, {})["semiperm"] = fit_units(av, bv)
        current = lift(narrow, wide, spec, seed=seed, fixed=fixed, dtype=torch.float64)
    return lift(narrow, wide, spec, seed=seed, fixed=fixed, inputs=inputs)


def _lift_all_but(problem_b: Any, canonical_b: Mapping[str, torch.Tensor], lifted: LiftResult,
                  keep: str) -> dict[str, torch.Tensor]:
    """B's canonical weights with every space lifted by ``lifted``'s maps except ``keep``
    (left at B's width): B's units of that space, written in A's frame."""
    actions = {n: _action(sl if n != keep else SpaceLift(n, "identity", sl.narrow, sl.narrow)) for n, sl in lifted.lifts.items()}
    return {k: lift_tensor(b, b, canonical_b[k], actions) for k, b in problem_b.params.items() if k in canonical_b}
