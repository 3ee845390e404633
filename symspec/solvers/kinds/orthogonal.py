"""Orthogonal groups by Procrustes: O(n), and OC(n) in the zero-mean subspace.

For orthogonal Q, co and contra coincide and ``||Q b||`` does not depend on Q, so
``sum w ||a - Q b||^2`` is smallest where ``tr(Q^T M)`` is largest, ``M = sum w a b^T``
(the cross-covariance of every incident weight, stacked): ``Q = U V^T`` from the SVD
``M = U S V^T``. OC(n) fixes the all-ones vector: in an orthonormal basis ``B`` of the
zero-mean subspace ``Q = B R B^T + 11^T/n``, and the same argument runs on ``B^T M B``.
"""

from __future__ import annotations

import torch

from ...groups import OC, Element, Group, centred_basis
from ..engine.base import SolveContext, Term, require_variances, solver


def procrustes(m: torch.Tensor, ctx: SolveContext | None = None) -> torch.Tensor:
    """The orthogonal matrix maximising tr(Q^T M) (batched).

    >>> q = procrustes(torch.tensor([[0.0, 2.0], [-3.0, 0.0]], dtype=torch.float64))
    >>> q.round().tolist()
    [[0.0, 1.0], [-1.0, 0.0]]
    """
    if m.dtype in (torch.float32, torch.float16, torch.bfloat16):
        # the SVD in float64: a float32 SVD can leave the rotation off by more than the
        # statistics' rounding (on an H200 a planted Mixtral stalled with every parameter
        # 1.4e-4 off, which points at the rotation; docs/matching.md), and d x d is small
        # beside the products that built M
        u, _, vh = torch.linalg.svd(m.double(), full_matrices=False)
        return (u @ vh).to(m.dtype)
    u, _, vh = torch.linalg.svd(m, full_matrices=False)
    return u @ vh


def _total(terms: list[Term]) -> torch.Tensor | None:
    out = None
    for t in terms:
        out = t.cross() if out is None else out + t.cross()
    return out


@solver("O", cheap_apply=False, batched=True)
def solve_orthogonal(group: Group, terms: list[Term], current: Element, ctx: SolveContext) -> Element:
    require_variances(group, terms, {"co", "contra"})
    m = _total(terms)
    if m is None:
        return current
    with ctx.timer("svd"):
        q = procrustes(m, ctx)
    return {"matrix": q.to(current["matrix"].dtype)}


@solver("OC", cheap_apply=False, batched=True)
def solve_centred_orthogonal(group: Group, terms: list[Term], current: Element, ctx: SolveContext) -> Element:
    require_variances(group, terms, {"co", "contra"})
    m = _total(terms)
    if m is None or group.n == 1:
        return current
    b = centred_basis(group.n).to(dtype=m.dtype, device=m.device)
    with ctx.timer("svd"):
        r = procrustes(b.mT @ m @ b, ctx)
    return {"matrix": OC.from_reduced(r).to(current["matrix"].dtype)}
