"""Experts(E, S(f)) with a scaling of the units right before it (``moe[i] @ up[i]``):
the expert permutation, each expert's unit permutation and the scales, solved together.

Without a scaling, a mixture-of-experts group is solved as the head group it is
(:mod:`.heads`). With one, coordinate descent between the permutations and the scales
locks in wrong matches (a unit's scale, fitted to the wrong partner, keeps it there), as
for a plain MLP (:func:`.assignment.solve_permuted_scaling`), so the score of a pair
(new unit i, old unit j) is the same: the permutation-only terms' correlation plus, for
the scaled terms, their value at one scale for both sides (:func:`.assignment.scaled_pair_score`). Then:

1. for every pair of experts (a, b), the best assignment of b's units to a's on the
   f x f block of that score (all E^2 assignments batched), worth ``V[a, b]``;
2. the expert permutation maximises ``V`` plus the routers' correlation ``C_router[a, b]``
   (the router's rows move with the experts);
3. with both fixed, the scales are solved exactly.

Exact for planted pairs. The score is dense over the E*f units: E^2 f^2 numbers, which
bounds the sizes this runs at (docs/matching.md).
"""

from __future__ import annotations

import torch

from ...groups import DiagonalGroup, Element, Experts, Group, Id, S
from ..engine.base import (
    SolveContext,
    SolverError,
    Term,
    joint_solver,
    prefetcher,
    require_variances,
    solver,
    solver_many,
)
from .assignment import assign, scaled_pair_score, scales_given
from .heads import prefetch_heads, solve_heads, solve_heads_many

# alone, an expert group is solved as the head group it is
solver("Experts", cheap_apply=True)(solve_heads)
solver_many("Experts")(solve_heads_many)
prefetcher("Experts")(prefetch_heads)


@joint_solver(("Experts", "D"), ("Experts", "Dpos"))
def solve_experts_scaling(outer: Group, inner: Group, terms: list[Term], current: tuple[Element, Element],
                          ctx: SolveContext) -> tuple[Element, Element]:
    require_variances(outer, terms, {"co", "contra", "abs"})
    if not isinstance(outer, Experts) or not isinstance(inner, DiagonalGroup):
        raise SolverError(f"{outer} with {inner} right before it is not a mixture of experts with scaled units")
    within = outer.within_group
    if not isinstance(within, (S, Id)):
        raise SolverError(f"{outer}: a scaling of the units needs permutations (S) or nothing (Id) inside the experts")
    e_outer, e_diag = current
    n_exp, f = outer.heads, within.n
    units = [t for t in terms if t.path == ()]
    router = [t for t in terms if t.path == ("router",) and t.role == "outer"]
    value: torch.Tensor | None = None
    for t in router:
        value = t.cross() if value is None else value + t.cross()
    score = scaled_pair_score(units, inner)
    inner_perm: torch.Tensor | None = None
    if score is not None:
        blocks = score.reshape(n_exp, f, n_exp, f).permute(0, 2, 1, 3)  # [a, b, f, f]
        if isinstance(within, S):
            with ctx.timer("assign"):
                inner_perm = assign(blocks, ctx)  # [a, b, f]
            fit = torch.gather(blocks, -1, inner_perm.unsqueeze(-1)).squeeze(-1).sum(-1)
        else:
            fit = torch.diagonal(blocks, dim1=-2, dim2=-1).sum(-1)
        value = fit if value is None else value + fit.to(value.dtype)
    if value is None:
        return e_outer, e_diag
    with ctx.timer("assign"):
        perm = assign(value, ctx)
    ar = torch.arange(n_exp, device=perm.device)
    if inner_perm is None:
        within_perm = outer.within(e_outer, "")
        # the units keep the permutation they had inside the expert that moves
        within_perm = {k: v[torch.argsort(e_outer["perm"].to(perm.device))[perm]] for k, v in within_perm.items()}
    else:
        within_perm = {"perm": inner_perm[ar, perm]}
    if isinstance(within, Id):
        within_perm = within.identity(batch=(n_exp,), device=perm.device)
        full = (perm[:, None] * f + torch.arange(f, device=perm.device)).reshape(-1)
    else:
        full = (perm[:, None] * f + within_perm["perm"]).reshape(-1)
    router_id = Id(1).identity(batch=(n_exp,), device=perm.device)
    element = outer._assemble(perm, torch.zeros(n_exp, 1, dtype=torch.int64, device=perm.device),
                              {"": within_perm, "router": router_id})
    return element, scales_given(full, units, inner, e_diag, ctx)
