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

Given the result's elements, :func:`certify` adds two more kinds of bound:

- per space, the others fixed at the result (:mod:`.space`): exact for the
  groups a solver minimises exactly (assignment, Procrustes, diagonal scalings, head
  permutations with trivial or orthogonal parts), a relaxation otherwise (GL and RoPE
  heads by least squares per piece, a permutation on two axes of one parameter by its
  doubly stochastic relaxation): whether the result is coordinate-wise optimal, and by
  how much each space could still improve;
- jointly over several spaces (:mod:`.joint`): over every permutation,
  head-permutation, O and OC space, spaces that interact (share a parameter) lifted
  together into a Shor SDP relaxation when small (``N = sum n_s^2 <= JOINT_LIMIT``)
  and, when they form a star (one hub, such as the residual, that each of the others
  interacts with alone), into the Gram SDP relaxation (size ``2 m`` plus the vectors the
  others move against the hub, at most ``GRAM_LIMIT``: a layer with the residual at
  n <= 64); those that interact with none maximised exactly; over all of them when every
  interacting group fits, else per layer, else "not available: too large".

A B that :func:`~symspec.alignment.align` lifted into A's widths (``info["lift"]``) is
certified as lifted: the bounds are over the group acting on the lifted B; the lift is
no part of the group, and the certificate says so.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs
import torch

from ..groups import NoEntry, has_entry
from ..problem import Problem
from ..statedict import squared_distance
from .joint import GRAM_LIMIT, JOINT_LIMIT, NEEDS_CVXPY, JointBound, joint_bounds
from .space import SpaceBound, space_bounds


@attrs.frozen
class Certificate:
    available: bool
    reason: str
    bound: float | None = None  # lower bound on min over the group of F
    value: float | None = None  # F at the result
    #: per parameter, how the bound was made (procrustes, von-neumann, rearrangement, norm, exact)
    kinds: Mapping[str, int] = attrs.field(factory=dict)
    #: per searched space, given the others at the result (empty without the elements)
    per_space: tuple[SpaceBound, ...] = ()
    #: the joint relaxations (empty without the elements)
    joint: tuple[JointBound, ...] = ()
    #: what align() lifted before aligning (None: nothing)
    lift: Mapping[str, Any] | None = None

    @property
    def gap(self) -> float | None:
        return None if self.bound is None or self.value is None else self.value - self.bound

    @property
    def relative_gap(self) -> float | None:
        g = self.gap
        return None if g is None or not self.value else g / self.value

    @property
    def not_available(self) -> list[str]:
        """Each bound that needs cvxpy and was not computed without it, as one line."""
        joint = [f"joint bound ({j.scope}): {what}: {NEEDS_CVXPY}" for j in self.joint for what in j.needs_cvxpy]
        space = [f"per-space bound of {b.space}: {b.needs_cvxpy}: {NEEDS_CVXPY}" for b in self.per_space if b.needs_cvxpy]
        return joint + space

    def to_dict(self) -> dict[str, Any]:
        return {"available": self.available, "reason": self.reason, "lower_bound": self.bound, "objective": self.value,
                "gap": self.gap, "relative_gap": self.relative_gap, "bound_kinds": dict(self.kinds),
                "per_space": [b.to_dict() for b in self.per_space], "joint": [j.to_dict() for j in self.joint],
                "not_available": self.not_available, **({"lift": dict(self.lift)} if self.lift else {})}

    def best_bound(self) -> float | None:
        """The largest lower bound on the whole objective's global minimum: the decoupled
        one, or a joint relaxation over every searched space (none fixed)."""
        whole = [j.bound for j in self.joint if j.available and j.whole and j.bound is not None]
        cands = ([self.bound] if self.bound is not None else []) + whole
        return max(cands) if cands else None


_MIXES = "its elements mix a vector's entries: the decoupled bound keeps only norms"
#: group kind -> how its elements move a vector's entries, where the decoupled bound uses it:
#: "permutation" (sorted entries paired) or "signed permutation" (sorted magnitudes; |rho(g)|
#: is a permutation, so an axis bound with abs() keeps its norm). A kind without an entry is
#: bounded by norms alone, and an abs() axis it acts on makes the bound not available.
ENTRYWISE: dict[str, str | NoEntry] = {
    "S": "permutation",
    "SP": "signed permutation",
    "Sign": "signed permutation",
    "O": NoEntry(_MIXES),
    "OC": NoEntry(_MIXES),
    "Heads": NoEntry(_MIXES + " (its within-head maps)"),
    "Experts": NoEntry(_MIXES + " (its within-expert maps)"),
    "Id": NoEntry("not modelled: a space held fixed (Id) is bounded by norms alone"),
    "GL": NoEntry("not norm-preserving: no decoupled bound"),
    "D": NoEntry("not norm-preserving: no decoupled bound"),
    "Dpos": NoEntry("not norm-preserving: no decoupled bound"),
    "RoPE": NoEntry("not norm-preserving: no decoupled bound"),
}


def _blockers(problem: Problem) -> list[str]:
    """Spaces whose group does not act by orthogonal matrices on some axis it binds."""
    out = []
    for b in problem.params.values():
        for ab in b.axes:
            for seg in ab.segments:
                for f in seg.factors:
                    group = problem.spaces[f.space].group
                    if not group.is_orthogonal(f.path) or (f.variance == "abs" and not has_entry(ENTRYWISE, group.kind)):
                        out.append(f"{f.space} ({group})")
    return sorted(set(out))


def _permutation_only(problem: Problem, axes: Any) -> tuple[bool, bool]:
    """(every factor a permutation, every factor a signed permutation) on these axes."""
    groups = [problem.spaces[f.space].group for ab in axes for s in ab.segments for f in s.factors]
    moves = [ENTRYWISE.get(g.kind) for g in groups]
    return all(m == "permutation" for m in moves), all(m in ("permutation", "signed permutation") for m in moves)


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
            aligned_b: Mapping[str, torch.Tensor], searched: Problem | None = None,
            elements: Mapping[str, Any] | None = None, *, per_space: bool = True, joint: bool = True,
            joint_limit: int = JOINT_LIMIT, gram_limit: int = GRAM_LIMIT,
            lift: Mapping[str, Any] | None = None) -> Certificate:
    """The lower bound and the gap of ``aligned_b`` (see the module). ``searched``: the
    problem with the groups that were searched (default: ``problem``'s). ``elements``:
    the result's element per space, in ``problem``'s groups (``aligned_b`` is canonical B
    moved by them); with them, the per-space bounds (``per_space``) and the joint
    relaxations (``joint``, lifted size at most ``joint_limit``, Gram size at most
    ``gram_limit``). ``lift``: what was
    lifted before aligning (``AlignResult.info["lift"]``), said in the reason."""
    groups = searched or problem
    extra: dict[str, Any] = {"lift": lift}
    if elements is not None and per_space:
        extra["per_space"] = tuple(space_bounds(problem, groups, canonical_a, canonical_b, elements))
    if elements is not None and joint:
        extra["joint"] = tuple(joint_bounds(problem, groups, canonical_a, canonical_b, elements, joint_limit,
                                                gram_limit))
    lifted = ""
    if lift:
        what = ", ".join(f"{k} {v['from']} -> {v['to']}" for k, v in list(lift.get("spaces", {}).items())[:4])
        lifted = (f"; B was lifted into A's widths before aligning ({lift.get('how', '?')} lift: {what}): these bounds "
                  "certify the alignment of the lifted B to A; the lift is not part of the group and is not certified")
    blockers = _blockers(groups)
    value = squared_distance(canonical_a, aligned_b, problem.params)
    if blockers:
        return Certificate(False, "no bound: these groups are not norm-preserving (the objective's decoupled "
                                  f"relaxation needs orthogonal actions): {', '.join(blockers[:4])}"
                           + (f" and {len(blockers) - 4} more" if len(blockers) > 4 else "") + lifted, value=value,
                           **extra)
    total = 0.0
    kinds: dict[str, int] = {}
    for name, b in groups.params.items():
        a_t, b_t = b.viewed(canonical_a[name].double()), b.viewed(canonical_b[name].double())  # as the axes see them
        if not b.axes:
            total += float((a_t - b_t).square().sum())
            kinds["exact"] = kinds.get("exact", 0) + 1
            continue
        u, kind = _upper(groups, b.axes, a_t, b_t)
        total += float(a_t.square().sum()) + float(b_t.square().sum()) - 2 * u
        kinds[kind] = kinds.get(kind, 0) + 1
    bound = max(total, 0.0)  # the objective is a sum of squares
    return Certificate(True, "decoupled relaxation: each parameter bounded over its own orthogonal maps "
                             "(Procrustes, von Neumann, rearrangement); a lower bound on the global minimum" + lifted,
                       bound, value, kinds, **extra)
