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
    value is exact to ~1e-14 of the terms, below the float32 rounding of the distance.

    With ``b_sq`` (an orthogonal action): ``<F G, F> = ||b||^2 + <G, F^T F - I>``, where
    ``F^T F - I`` is of the order of the working precision's eps, so ``G`` in that
    precision (``gram_eps``) is exact enough, and costs half a float64 product."""

    cross: torch.Tensor
    gram: torch.Tensor
    rows_sq: torch.Tensor
    #: products summed per entry (the columns), for the error estimate
    length: int
    #: sum w ||b||^2 in float64 (orthogonal actions), else None: ``gram`` is float64
    b_sq: float | None = None
    #: the eps of the precision ``gram`` was computed in
    gram_eps: float = 0.0

    @property
    def a_sq(self) -> float:
        return float(self.rows_sq.sum())

    def objective(self, f: torch.Tensor) -> tuple[float, float]:
        """The objective for the action matrix ``f`` (float64) and its error bound."""
        lin = float((f * self.cross).sum())
        a_sq = self.a_sq
        n = f.shape[-1]
        eps64 = torch.finfo(torch.float64).eps
        extra = 0.0
        if self.b_sq is None:
            # ||F b||^2 = <F G, F> in full: F in a float32 group is orthogonal only to ~1e-7,
            # so ||b||^2 in its place is off by far more than a planted pair's whole objective
            quad = float(((f @ self.gram) * f).sum())
        else:
            e = f.mT @ f - torch.eye(n, dtype=f.dtype, device=f.device)
            quad = self.b_sq + float((self.gram * e).sum())
            # G's rounding (about gram_eps sqrt(length) of ||G||) against F^T F - I
            extra = math.sqrt(self.length) * self.gram_eps * float(torch.linalg.matrix_norm(self.gram) * torch.linalg.matrix_norm(e))
        # float64 sums of ``length`` products per statistic, then of n^2 entries
        err = math.sqrt(self.length + n * n) * eps64 * (a_sq + 2 * abs(lin) + quad)
        return a_sq - 2 * lin + quad, err + extra


class _Blocks:
    """Blocks of columns of ``x`` [n, m] converted to float64 into one buffer, laid out as
    ``x`` is (an embedding's segment is often its transpose: copying it into row-major
    blocks transposes it, 10x slower than a straight copy)."""

    def __init__(self, x: torch.Tensor, step: int) -> None:
        self.x = x
        self.trans = x.stride(-2) == 1 and x.stride(-1) != 1
        shape = (step, x.shape[0]) if self.trans else (x.shape[0], step)
        self.buf = torch.empty(shape, dtype=torch.float64, device=x.device)

    def take(self, i: int, k: int) -> torch.Tensor:
        if self.trans:
            return self.buf[:k].copy_(self.x[:, i : i + k].mT).mT
        return self.buf[:, :k].copy_(self.x[:, i : i + k])


def exact_stats(a: torch.Tensor, b: torch.Tensor, w: float, orthogonal: bool = False) -> ExactStats:
    """``w a b^T``, ``w b b^T`` and ``w ||a_i||^2`` for ``a``, ``b`` [n, m]
    in float64 (the products of two float32 values are exact in float64), a block of
    ``EXACT_BLOCK_BYTES`` at a time, converted into two blocks kept for the whole loop
    (fresh 16 MiB blocks were page-faulted in, every one). ``orthogonal`` (an orthogonal
    action): ``w b b^T`` in ``b``'s precision instead, and ``w ||b||^2`` in float64
    (:class:`ExactStats`): one float64 product instead of two."""
    n, m = a.shape
    step = min(m, max(256, EXACT_BLOCK_BYTES // (8 * max(n, 1))))
    f64 = {"dtype": torch.float64, "device": a.device}
    cross = torch.zeros(n, n, **f64)  # type: ignore[arg-type]
    gram = torch.zeros(n, n, **f64) if not orthogonal else None  # type: ignore[arg-type]
    rows = torch.zeros(n, **f64)  # type: ignore[arg-type]
    b_rows = torch.zeros(n, **f64)  # type: ignore[arg-type]
    blocks = _Blocks(a, step), _Blocks(b, step)
    for i in range(0, m, step):
        k = min(step, m - i)
        x, y = (blk.take(i, k) for blk in blocks)
        cross.addmm_(x, y.mT)
        if gram is not None:
            gram.addmm_(y, y.mT)
        rows += x.square_().sum(-1)
        b_rows += y.square_().sum(-1)
    if gram is None:
        return ExactStats(w * cross, w * (b @ b.mT).to(torch.float64), w * rows, m, b_sq=w * float(b_rows.sum()),
                          gram_eps=torch.finfo(b.dtype).eps)
    return ExactStats(w * cross, w * gram, w * rows, m)
