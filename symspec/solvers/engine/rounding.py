"""How exact the weight objective is (docs/matching.md, "Precision").

Three things: squared distances summed in float64 (:func:`sqdist`), float64 statistics
for parameters reduced once to them (:func:`exact_stats`), and the rounding level of a
parameter's objective (:func:`rounding_level`), below which a change is noise that no
decision may rest on.
"""

from __future__ import annotations

import math

import attrs
import torch


def sqdist(a: torch.Tensor, b: torch.Tensor, chunk: int = 1 << 15) -> float:
    """||a - b||^2 accumulated in float64, in chunks: no temporaries the size of a large
    weight (fresh allocations of hundreds of MB page-fault their way in, every time), and
    each chunk's temporaries stay in the cache and under the mmap threshold that
    ``symspec match`` sets (:mod:`symspec.process`; 128 KB chunks: 3x faster than 16 MB
    ones on a 20M-element pair there, the same result to 1e-11)."""
    fa, fb = a.reshape(-1), b.reshape(-1)
    if fa.numel() <= chunk:
        return float((fa - fb).square().sum(dtype=torch.float64))
    total = 0.0
    for i in range(0, fa.numel(), chunk):
        d = fa[i : i + chunk] - fb[i : i + chunk]
        total += float(d.square().sum(dtype=torch.float64))
    return total


def sqnorm(x: torch.Tensor, chunk: int = 1 << 15) -> float:
    """||x||^2 accumulated in float64, in chunks (see :func:`sqdist`)."""
    fx = x.reshape(-1)
    return math.fsum(float(fx[i : i + chunk].square().sum(dtype=torch.float64)) for i in range(0, fx.numel(), chunk))


#: The rounding level of the objective. Two values of one parameter's objective are
#: told apart only when they differ by more than both their levels together: what the
#: working precision leaves of the difference itself (``EVAL_ROUNDING`` eps of the value:
#: the difference of two stored weights and its square are rounded once each) plus what
#: it leaves of the stored transformed weights: a product of width n rounds every entry
#: by about sqrt(n) eps of its size, so the weights of B move by
#: ``u = STATE_ROUNDING eps sqrt(width) ||B||`` (width summed over the parameter's axes)
#: and the objective by ``2 sqrt(v) u / sqrt(numel)`` (random signs) plus ``u^2``: the
#: floor a planted pair ends on. Measured on planted float32 pairs (d 16 to 64): 17 to
#: 490 eps^2 ||B||^2, where a decision needs more than 2 u^2 = 2 (d + d) eps^2 ||B||^2
#: per square weight; STATE_ROUNDING 4 stopped them 10x above that floor, with real
#: gains left.
EVAL_ROUNDING = 2.0
STATE_ROUNDING = 1.0


def state_rounding_sq(eps: float, width: int, weight: float, b_sq: float) -> float:
    """``u^2``: how far the rounding of B's stored transformed weights moves the objective's
    weights (squared), for weights of squared norm ``b_sq`` counted ``weight`` times and
    acted on by products of total ``width``."""
    return (STATE_ROUNDING * eps) ** 2 * width * weight * b_sq


def rounding_level(value: float, err: float, u2: float, numel: int) -> float:
    """The rounding level of a parameter's objective ``value`` (computed with error
    ``err``; ``u2`` from :func:`state_rounding_sq`, over ``numel`` weights): a change
    smaller than it is rounding noise."""
    return err + 2.0 * math.sqrt(max(value, 0.0) * u2 / numel) + u2


#: bytes of one float64 block of a static term's exact statistics: the data is
#: converted a block of columns at a time, never a float64 copy of a whole embedding
EXACT_BLOCK_BYTES = 1 << 24


@attrs.frozen
class ExactStats:
    """A static term's statistics in float64, for its objective
    ``||a||^2 - 2 <F, C> + <F G, F>``: with float32 statistics those three large terms
    cancel to float32 noise (a negative objective, decisions on noise); in float64 the
    value is exact to ~1e-14 of the terms, below the float32 rounding of the distance."""

    cross: torch.Tensor
    gram: torch.Tensor
    rows_sq: torch.Tensor
    #: products summed per entry (the columns), for the error estimate
    length: int

    @property
    def a_sq(self) -> float:
        return float(self.rows_sq.sum())

    def objective(self, f: torch.Tensor) -> tuple[float, float]:
        """The objective for the action matrix ``f`` (float64) and its error bound."""
        # ||F b||^2 = <F G, F> in full: F in a float32 group is orthogonal only to ~1e-7,
        # so ||b||^2 in its place is off by far more than a planted pair's whole objective
        lin = float((f * self.cross).sum())
        quad = float(((f @ self.gram) * f).sum())
        a_sq = self.a_sq
        # float64 sums of ``length`` products per statistic, then of n^2 entries
        n = f.shape[-1]
        err = math.sqrt(self.length + n * n) * torch.finfo(torch.float64).eps * (a_sq + 2 * abs(lin) + quad)
        return a_sq - 2 * lin + quad, err


def exact_stats(a: torch.Tensor, b: torch.Tensor, w: float) -> ExactStats:
    """``w a b^T``, ``w b b^T`` and ``w ||a_i||^2`` for ``a``, ``b`` [n, m]
    in float64 (the products of two float32 values are exact in float64), a block of
    ``EXACT_BLOCK_BYTES`` at a time. Two float64 products where the float32 path had one
    (C): ~3x its time, once per match (0.44 s -> 1.2 s for a GPT-2 embedding on 2 cores,
    about the float64 peak)."""
    n, m = a.shape
    step = max(256, EXACT_BLOCK_BYTES // (8 * max(n, 1)))
    cross = torch.zeros(n, n, dtype=torch.float64, device=a.device)
    gram = torch.zeros(n, n, dtype=torch.float64, device=a.device)
    rows = torch.zeros(n, dtype=torch.float64, device=a.device)
    for i in range(0, m, step):
        x = a[:, i : i + step].to(torch.float64)
        y = b[:, i : i + step].to(torch.float64)
        cross.addmm_(x, y.mT)
        gram.addmm_(y, y.mT)
        rows += x.square().sum(-1)
    return ExactStats(w * cross, w * gram, w * rows, m)
