"""Running cvxpy's solvers so that Ctrl-C stops the command, and a failed solve never
retries on a solver that cannot hold the problem.

SCS installs its own SIGINT handler while it iterates: Python never sees the signal,
SCS returns with status "interrupted" and cvxpy reports that as a SolverError (the same
as a numerical failure). The certificates took it for a failed solve and retried with
Clarabel, whose interior-point KKT system is dense in a PSD cone's entries: on the Gram
relaxation of a small GPT-2's layer (a 574 x 574 PSD matrix, 165025 entries) that is
165025^2 doubles, and Ctrl-C ended 25 s later in "memory allocation of 217866005000
bytes failed" and an abort. :func:`solve` turns SCS's interrupt back into
KeyboardInterrupt; :func:`interior_point_bytes` says what Clarabel would need before a
fallback asks it.
"""

from __future__ import annotations

from typing import Any

#: SCS's status value when SIGINT arrived during its iterations (scs/include/glbopts.h)
SCS_SIGINT = -5
#: an interior-point fallback is tried only below this much memory for its KKT system
INTERIOR_POINT_MAX_BYTES = 2 * 2**30


def solve(prob: Any, solver: str, **opts: Any) -> None:
    """``prob.solve(solver=solver, **opts)``, except that an SCS solve interrupted by
    SIGINT raises KeyboardInterrupt instead of cvxpy's SolverError."""
    import cvxpy as cp  # optional: the convex extra

    if solver != cp.SCS:
        prob.solve(solver=solver, **opts)
        return
    data, chain, inverse = prob.get_problem_data(solver)
    raw = chain.solve_via_data(prob, data, solver_opts=opts)
    info = raw.get("info", {}) if isinstance(raw, dict) else {}
    if info.get("status_val", info.get("statusVal")) == SCS_SIGINT:
        raise KeyboardInterrupt
    prob.unpack_results(raw, chain, inverse)


def interior_point_bytes(prob: Any) -> int:
    """About what an interior-point solver (Clarabel) allocates for ``prob``'s KKT system:
    dense in the entries of each PSD cone (t = n (n + 1) / 2 of them for an n x n matrix)."""
    total = 0
    for v in prob.variables():
        if v.is_psd() or v.is_nsd():
            n = int(v.shape[0])
            t = n * (n + 1) // 2
            total += 8 * t * t
    return total
