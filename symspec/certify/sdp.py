"""Solving a relaxation's semidefinite program with cvxpy (an optional dependency,
imported when a relaxation is solved): SCS, Clarabel where SCS fails and the problem
fits (:mod:`symspec.solvers.convex`); the callers certify their bound from the
multipliers, so the solver's accuracy costs only tightness.
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np

from ..solvers import convex

#: SCS iterations at most (its inaccuracy loosens the certified bound, never breaks it)
SCS_ITERS = 1500


def sym(vec: np.ndarray, n1: int) -> np.ndarray:
    m = vec.reshape(n1, n1, order="F")
    return 0.5 * (m + m.T)


class SDPFailed(RuntimeError):
    """The relaxation could not be solved (the bound is then not available)."""


def solve_sdp(prob: Any, constraint: Any, eps: float) -> str:
    """Solve ``prob`` (SCS, Clarabel if SCS fails and the problem is small) for
    ``constraint``'s multipliers; the solver's name. SCS (first order) is ~10x faster
    than Clarabel's interior point here, whose KKT system is dense in a PSD cone's
    entries (a 574 x 574 Gram matrix: 218 GB); its inaccuracy costs only tightness,
    never validity (the callers certify the bound from the multipliers). Ctrl-C during
    SCS is KeyboardInterrupt (:func:`symspec.solvers.convex.solve`), never a retry."""
    import cvxpy as cp  # optional: the convex extra

    used = "SCS"
    with warnings.catch_warnings():  # "may be inaccurate": the certificate accounts for it
        warnings.filterwarnings("ignore", message="Solution may be inaccurate")
        try:
            convex.solve(prob, cp.SCS, eps=eps, max_iters=SCS_ITERS)
        except cp.error.SolverError as e:
            need = convex.interior_point_bytes(prob)
            if need > convex.INTERIOR_POINT_MAX_BYTES:
                raise SDPFailed(f"SCS failed ({e}) and Clarabel would need about {need / 2**30:.0f} GiB") from e
            used = "CLARABEL"
            try:
                prob.solve(solver=cp.CLARABEL)
            except cp.error.SolverError as e2:
                raise SDPFailed(f"SCS and Clarabel failed ({e2})") from e2
    if constraint.dual_value is None:
        raise SDPFailed(f"the SDP solver returned no multipliers ({prob.status})")
    return used

