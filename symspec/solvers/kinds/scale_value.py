"""The value of a pair of units at its own best scale: :func:`best_scale_value`, the
pair score of a permutation with a diagonal scaling right before it
(:func:`.assignment.scaled_pair_score`), for every pair of units of a layer: dozens of
elementwise passes over arrays of f x f entries, each pass in place on temporaries
that a :class:`ScaleWork` keeps from one chunk to the next.
"""

from __future__ import annotations

import functools
import math

import torch

#: Newton steps that polish the best candidate scale of every pair (best_scale_value)
SCALE_NEWTON_STEPS = 2

Coef = torch.Tensor | float


class ScaleWork:
    """Named temporaries of :func:`best_scale_value`, reused from one call to the next
    (chunks of one pair score): every pass writes into one of them, so a chunk allocates
    nothing (freed temporaries page-fault their way back in wherever glibc trims its heap,
    as it does under the allocator settings of ``symspec match``)."""

    def __init__(self) -> None:
        self._bufs: dict[tuple[str, torch.dtype, torch.device], torch.Tensor] = {}
        self.shape = torch.Size()
        self.dtype = torch.float64
        self.device = torch.device("cpu")

    def start(self, shape: torch.Size, dtype: torch.dtype, device: torch.device) -> None:
        """The shape, dtype and device of the temporaries from now on."""
        self.shape, self.dtype, self.device = shape, dtype, device

    def get(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The temporary called ``name`` (of the current shape; ``dtype`` default the current)."""
        key = (name, dtype or self.dtype, self.device)
        n = math.prod(self.shape)
        buf = self._bufs.get(key)
        if buf is None or buf.numel() < n:
            buf = self._bufs[key] = torch.empty(n, dtype=key[1], device=self.device)
        return buf[:n].view(self.shape)


def _take(w: ScaleWork, bv: torch.Tensor, bd: torch.Tensor, v: torch.Tensor, d: torch.Tensor) -> None:
    """bv, bd <- v, d where v is larger (a NaN value never is), in place; v and d are
    overwritten. Arithmetic on a 0/1 mask (bd is always finite, and so is every d taken):
    torch.where's and masked_fill's CPU kernels are 5-25x slower than a product."""
    take = torch.gt(v, bv, out=w.get("take"))
    torch.maximum(bv, torch.nan_to_num_(v, nan=-math.inf, posinf=math.inf, neginf=-math.inf), out=bv)
    keep = torch.neg(take, out=w.get("keep")).add_(1.0)
    bd.mul_(keep).add_(torch.nan_to_num_(d, nan=0.0, posinf=0.0, neginf=0.0).mul_(take))


def _scale_value(w: ScaleWork, d: torch.Tensor, lin2: Coef, g: torch.Tensor, ct2: Coef, g_ct: Coef,
                 sigma: float | None) -> torch.Tensor:
    """``d (2 lin - g d) + (2 c_ct - g_ct / d) / d`` (``lin2``, ``ct2``: the coefficients
    doubled) into ``w``'s "v". Where d is 0 or infinite it comes out -inf or NaN (g, g_ct
    >= 0): never taken; so does a d of the wrong sign (``sigma``), divided by 0 first."""
    if sigma is not None:
        d.div_(torch.gt(torch.mul(d, sigma, out=w.get("u")), 0, out=w.get("u")))
    v = torch.mul(g, d, out=w.get("v")).sub_(lin2).neg_().mul_(d)  # -(x - y) is y - x exactly
    if isinstance(g_ct, torch.Tensor):
        inv = torch.reciprocal(d, out=w.get("inv"))
        v.add_(torch.mul(g_ct, inv, out=w.get("u")).sub_(ct2).neg_().mul_(inv))
    return v


def _newton_scale(w: ScaleWork, bv: torch.Tensor, bd: torch.Tensor, lin: Coef, lin2: Coef, g: torch.Tensor,
                  c_ct: Coef, ct2: Coef, g_ct: torch.Tensor, sigma: float | None) -> None:
    """One Newton step on the value from every scale ``bd`` (value ``bv``), kept where it
    raises the value (in place): half the first and second derivatives are
    ``lin - g d + (g_ct / d - c_ct) / d^2`` and ``(2 c_ct - 3 g_ct / d) / d^3 - g``; a step
    only where the value is concave."""
    inv = torch.reciprocal(bd, out=w.get("n_inv"))
    v1 = torch.mul(g_ct, inv, out=w.get("v1")).sub_(c_ct).mul_(inv).mul_(inv).add_(lin)
    v1.sub_(torch.mul(g, bd, out=w.get("moved")))
    v2 = torch.mul(3 * g_ct, inv, out=w.get("v2")).sub_(ct2).neg_().mul_(inv).mul_(inv).mul_(inv).sub_(g)
    # no step where v2 >= 0: a step of 0 (no gain: not taken) or NaN (never taken)
    moved = torch.sub(bd, v1.div_(v2).mul_(torch.lt(v2, 0, out=w.get("take"))), out=w.get("moved"))
    _take(w, bv, bd, _scale_value(w, moved, lin2, g, ct2, g_ct, sigma), moved)


def _best_on_sign(w: ScaleWork, lin: Coef, g: torch.Tensor, c_ct: Coef, g_ct: Coef, sigma: float | None,
                  slot: str) -> torch.Tensor:
    """The best value over d on one sign (``sigma``; None: both, valid without abs terms),
    into ``w``'s ``slot``."""
    lin2, ct2 = 2 * lin, 2 * c_ct
    bv = w.get(slot).fill_(-torch.inf)
    bd = w.get("bd").zero_()
    d = w.get("d")
    for num, den in ((lin, g), (g_ct, c_ct)) if isinstance(g_ct, torch.Tensor) else ((lin, g),):
        d.copy_(torch.as_tensor(num, dtype=w.dtype, device=w.device)).div_(den)
        _take(w, bv, bd, _scale_value(w, d, lin2, g, ct2, g_ct, sigma), d)
    if not isinstance(g_ct, torch.Tensor):
        return bv  # co terms alone: lin / g is the optimum
    # the balance +-bal, bal = (g_ct / g)^(1/4) (of a valid sign wherever both sides have
    # data): there g d^2 = g_ct / d^2, so the value is +-S - K with S = 2 lin bal + 2 c_ct / bal
    # and K = g bal^2 + g_ct / bal^2 (NaN where bal is 0 or infinite: never taken)
    bal = (g_ct / g) ** 0.25
    ibal = torch.reciprocal(bal)
    k = g * bal.square() + g_ct * ibal.square()
    s = w.get("u").copy_(ibal).mul_(ct2).add_(w.get("v").copy_(bal).mul_(lin2))
    if sigma is None:
        torch.copysign(bal, s, out=d)
        _take(w, bv, bd, s.abs_().sub_(k), d)
    else:
        d.copy_(bal).mul_(sigma)
        _take(w, bv, bd, s.mul_(sigma).sub_(k), d)
    for _ in range(SCALE_NEWTON_STEPS):
        _newton_scale(w, bv, bd, lin, lin2, g, c_ct, ct2, g_ct, sigma)
    return bv


def _begin(coef: dict[str, torch.Tensor | float], work: ScaleWork | None) -> tuple[ScaleWork, tuple[Coef, ...], torch.Tensor]:
    """A pair value's start: its temporaries set to the coefficients' broadcast shape and
    dtype, (c_co, c_ct, g_ct, c_ab), and the co side's Gram g_co + g_ab as a tensor (x / 0
    is inf, not an error)."""
    tensors = [v for v in coef.values() if isinstance(v, torch.Tensor)]
    w = work or ScaleWork()
    w.start(torch.broadcast_shapes(*(v.shape for v in tensors)), functools.reduce(torch.promote_types, (v.dtype for v in tensors)),
            tensors[0].device)
    g = torch.as_tensor(coef["g_co"] + coef["g_ab"], dtype=w.dtype, device=w.device)
    return w, (coef["c_co"], coef["c_ct"], coef["g_ct"], coef["c_ab"]), g


def best_scale_value(coef: dict[str, torch.Tensor | float], positive: bool, work: ScaleWork | None = None) -> torch.Tensor:
    """The value ``max_d 2 c_co d - g_co d^2 + 2 c_ct / d - g_ct / d^2 + 2 c_ab |d| - g_ab d^2``
    of a unit at its own scale (d != 0; d > 0 if ``positive``), elementwise over the
    coefficients' broadcast shape, in their dtype; a coefficient may be the float 0 (no
    such term), which costs nothing. With ``work`` the result is one of its temporaries
    (valid until its next use).

    Candidates per sign: the co-only optimum, the contra-only optimum and the balance
    +-(g_ct / g_co)^(1/4); the best is polished by :data:`SCALE_NEWTON_STEPS` Newton steps,
    each kept only where it raises the value on the same sign. Exact where the two optima
    agree (planted pairs); otherwise a value some scale attains (never more than the
    maximum). Poor pairs may stop at a lesser local maximum; the good ones, which the
    assignment chooses among, are nearly always exact (bench/bench_pair_score.py: on
    random statistics about half of all pairs but 99% of each row's five best are within
    1e-6 of the maximum over the quartic's roots). Without contra terms the supremum 0
    (d -> 0) counts too. It runs on every pair of units (``assignment.scaled_pair_score``,
    in chunks that stay in the cache), every pass in place.

    >>> float(best_scale_value({"c_co": torch.tensor(2.0), "g_co": 1.0, "c_ct": 0.5, "g_ct": torch.tensor(1.0),
    ...                         "c_ab": 0.0, "g_ab": 0.0}, positive=True))
    4.25
    """
    w, (c_co, c_ct, g_ct, c_ab), g = _begin(coef, work)
    # without abs terms one pass serves both signs: each candidate is valid on its own sign
    signs: tuple[float | None, ...] = (1.0,) if positive else ((None,) if not isinstance(c_ab, torch.Tensor) else (1.0, -1.0))
    best: torch.Tensor | None = None
    for k, sigma in enumerate(signs):
        lin = c_co + sigma * c_ab if sigma is not None else c_co
        bv = _best_on_sign(w, lin, g, c_ct, g_ct, sigma, f"best{k}")
        best = bv if best is None else torch.maximum(best, bv, out=best)
    assert best is not None
    if not isinstance(g_ct, torch.Tensor):
        return best.clamp_min_(0.0)
    # no valid candidate: no co data (g == 0), where the value tends to 0 as |d| grows
    torch.nan_to_num_(best, nan=0.0, posinf=math.inf, neginf=0.0)
    return torch.where(g_ct == 0, best.clamp_min(0.0), best) if bool((g_ct == 0).any()) else best


def scale_value_bound(coef: dict[str, torch.Tensor | float], positive: bool, work: ScaleWork | None = None) -> torch.Tensor:
    """An upper bound of the value :func:`best_scale_value` maximises: each side at its own
    best scale, ``max(+-lin, 0)^2 / g`` for the co (and abs) terms plus ``c_ct^2 / g_ct``
    for the contra ones (on d > 0 alone where ``positive``), elementwise in the
    coefficients' dtype. Equal to the maximum where the two sides' optima agree (planted
    pairs); +inf where a side has correlation but no Gram. A few passes, against the
    dozens of :func:`best_scale_value`: what ranks the pairs worth scoring exactly
    (:func:`.assignment.assign_scaled`). With ``work`` the result is one of its
    temporaries.

    >>> float(scale_value_bound({"c_co": torch.tensor(2.0), "g_co": 1.0, "c_ct": 0.5, "g_ct": torch.tensor(1.0),
    ...                          "c_ab": 0.0, "g_ab": 0.0}, positive=True))
    4.25
    """
    w, (c_co, c_ct, g_ct, c_ab), g = _begin(coef, work)
    # per old unit, so cheap: 1 / g (inf where a unit has no Gram: there the bound is
    # inf, or NaN for no correlation either, which counts as 0)
    holes = bool((g == 0).any()) or (isinstance(g_ct, torch.Tensor) and bool((g_ct == 0).any()))
    out = w.get("bound")
    if positive or isinstance(c_ab, torch.Tensor):
        lin = w.get("d").copy_(torch.as_tensor(c_co, dtype=w.dtype, device=w.device))
        # positive: max(c_co + c_ab, 0); else the better sign: max(c_co + c_ab, c_ab - c_co, 0)
        (lin if positive else lin.abs_()).add_(c_ab).clamp_min_(0.0)
    else:
        lin = torch.as_tensor(c_co, dtype=w.dtype, device=w.device)
    if lin.shape == out.shape:
        torch.mul(lin, lin, out=out).mul_(torch.reciprocal(g))
    else:  # no co correlation per pair (a float, or a term of old units alone)
        out.copy_(torch.reciprocal(g)).mul_(lin.square())
    if holes:
        torch.nan_to_num_(out, nan=0.0, posinf=math.inf)
    if isinstance(c_ct, torch.Tensor) or c_ct != 0:
        sq = w.get("u").copy_(torch.as_tensor(c_ct, dtype=w.dtype, device=w.device))
        if positive:
            sq.clamp_min_(0.0)
        part = sq.mul_(sq).mul_(torch.reciprocal(torch.as_tensor(g_ct, dtype=w.dtype, device=w.device)))
        out.add_(torch.nan_to_num_(part, nan=0.0, posinf=math.inf) if holes else part)
    return out
