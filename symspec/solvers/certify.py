"""How far a weight-matching result can be from the best one: a lower bound on the
objective's global minimum over the searched group.

The objective is F(g) = sum_p ||A_p - g.B_p||^2 over the bound parameters. When every
searched group acts by orthogonal matrices (permutations, signed permutations,
orthogonal maps, heads with such parts), ||g.B_p|| = ||B_p|| and

    F(g) = sum_p ||A_p||^2 + ||B_p||^2 - 2 <A_p, g.B_p>,

so any upper bound U_p on <A_p, g.B_p> that holds for every g gives a lower bound on
min F. The bound here decouples the parameters (each may take its own orthogonal maps,
a relaxation of the shared group element) and bounds each exactly for that relaxation:

- a parameter moved on one axis: max over orthogonal M of <A, M B> = ||A B^T||_*
  (the Procrustes value, with the other axes flattened);
- on two axes of a matrix: max over orthogonal M, N of <A, M B N^T> = sum_i s_i(A) s_i(B)
  (von Neumann's trace inequality);
- a vector under permutations: the sorted entries paired (the rearrangement
  inequality), with signs: the sorted magnitudes; under orthogonal maps: ||a|| ||b||;
- anything else bound: ||A|| ||B|| (Cauchy-Schwarz); unbound: ||A - B||^2 exactly.

The bound is global (not conditional on the other spaces), cheap (one SVD per
parameter), and exact on planted pairs (A = g.B: every U_p is reached, the bound is 0 and
so is the gap of a result that recovers g). It is *not available* when a searched group
is not norm-preserving (GL maps, diagonal scalings, the RoPE commutant): then
:func:`certify` says so and gives no number.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs
import torch

from ..groups import SP, S
from ..groups.classic import Sign
from ..problem import Problem
from ..statedict import squared_distance


@attrs.frozen
class Certificate:
    available: bool
    reason: str
    bound: float | None = None  # lower bound on min over the group of F
    value: float | None = None  # F at the result
    #: per parameter, how the bound was made (procrustes, von-neumann, rearrangement, norm, exact)
    kinds: Mapping[str, int] = attrs.field(factory=dict)

    @property
    def gap(self) -> float | None:
        return None if self.bound is None or self.value is None else self.value - self.bound

    @property
    def relative_gap(self) -> float | None:
        g = self.gap
        return None if g is None or not self.value else g / self.value

    def to_dict(self) -> dict[str, Any]:
        return {"available": self.available, "reason": self.reason, "lower_bound": self.bound, "objective": self.value,
                "gap": self.gap, "relative_gap": self.relative_gap, "bound_kinds": dict(self.kinds)}


def _blockers(problem: Problem) -> list[str]:
    """Spaces whose group does not act by orthogonal matrices on some axis it binds."""
    out = []
    for b in problem.params.values():
        for ab in b.axes:
            for seg in ab.segments:
                for f in seg.factors:
                    group = problem.spaces[f.space].group
                    if not group.is_orthogonal(f.path) or (f.variance == "abs" and not isinstance(group, (S, SP, Sign))):
                        out.append(f"{f.space} ({group})")
    return sorted(set(out))


def _permutation_only(problem: Problem, axes: Any) -> tuple[bool, bool]:
    """(every factor a permutation, every factor a signed permutation) on these axes."""
    groups = [problem.spaces[f.space].group for ab in axes for s in ab.segments for f in s.factors]
    return all(isinstance(g, S) for g in groups), all(isinstance(g, (S, SP, Sign)) for g in groups)


def _upper(problem: Problem, axes: Any, a: torch.Tensor, b: torch.Tensor) -> tuple[float, str]:
    """An upper bound on <A, g.B> over every g (see the module)."""
    if a.ndim == 1:
        perm, signed = _permutation_only(problem, axes)
        if perm:
            return float(torch.sort(a).values @ torch.sort(b).values), "rearrangement"
        if signed:
            return float(torch.sort(a.abs()).values @ torch.sort(b.abs()).values), "rearrangement"
        return float(a.norm() * b.norm()), "norm"
    bound_axes = sorted({ab.axis for ab in axes})
    if len(bound_axes) == 1:
        ax = bound_axes[0]
        am = a.movedim(ax, 0).reshape(a.shape[ax], -1)
        bm = b.movedim(ax, 0).reshape(b.shape[ax], -1)
        return float(torch.linalg.svdvals(am @ bm.T).sum()), "procrustes"
    if a.ndim == 2 and len(bound_axes) == 2:
        return float(torch.linalg.svdvals(a) @ torch.linalg.svdvals(b)), "von-neumann"
    return float(a.norm() * b.norm()), "norm"


def certify(problem: Problem, canonical_a: Mapping[str, torch.Tensor], canonical_b: Mapping[str, torch.Tensor],
            aligned_b: Mapping[str, torch.Tensor], searched: Problem | None = None) -> Certificate:
    """The lower bound and the gap of ``aligned_b`` (see the module). ``searched``: the
    problem with the groups that were searched (default: ``problem``'s)."""
    groups = searched or problem
    blockers = _blockers(groups)
    value = squared_distance(canonical_a, aligned_b, problem.params)
    if blockers:
        return Certificate(False, "no bound: these groups are not norm-preserving (the objective's decoupled "
                                  f"relaxation needs orthogonal actions): {', '.join(blockers[:4])}"
                           + (f" and {len(blockers) - 4} more" if len(blockers) > 4 else ""), value=value)
    total = 0.0
    kinds: dict[str, int] = {}
    for name, b in groups.params.items():
        a_t, b_t = canonical_a[name].double(), canonical_b[name].double()
        if not b.axes:
            total += float((a_t - b_t).square().sum())
            kinds["exact"] = kinds.get("exact", 0) + 1
            continue
        u, kind = _upper(groups, b.axes, a_t, b_t)
        total += float(a_t.square().sum()) + float(b_t.square().sum()) - 2 * u
        kinds[kind] = kinds.get(kind, 0) + 1
    bound = max(total, 0.0)  # the objective is a sum of squares
    return Certificate(True, "decoupled relaxation: each parameter bounded over its own orthogonal maps "
                             "(Procrustes, von Neumann, rearrangement); a lower bound on the global minimum",
                       bound, value, kinds)
