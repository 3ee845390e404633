"""Heads(H, parts..., kv=K): a head permutation, then each part's within-head maps.

1. The head permutation comes from an assignment on a similarity of heads that the
   within-head maps cannot change. For a part whose within group is not orthogonal and
   whose terms act on both sides of a pairing (QK: queries ``co``, keys ``contra``; OV:
   values ``co``, the output projection ``contra``) it is the inner product of the
   per-head circuits ``Co_h^T Ct_h`` (W_Q^T W_K, W_V^T W_O^T: GL-invariant), computed
   from dh x dh blocks of the cross-covariances, ``<Co_a Co_b^T, Ct_a Ct_b^T>``, never
   from d x d circuits. Every other part uses its within group's best fit
   (:meth:`~symspec.groups.Group.best_fit`): the trace for the trivial group (exact),
   the nuclear norm of the block for orthogonal groups (co and contra coincide), the
   least-squares fit ``tr(C G^-1 C^T)`` otherwise.
2. With grouped-query attention (K < H) the assignment is nested: for every pair of
   key/value groups, an inner assignment of their query heads; then the outer one.
3. With the permutation fixed, each part's within-head elements are solved by the
   within group's own solver, batched over the K key/value heads. A GL part whose
   statistics do not reach every direction of the head (a head of A wider than what B
   writes into it: B lifted into wider heads, where B's rows span dh_B of A's dh_A dims)
   is anchored there (:func:`_anchor_terms`): left alone, the GL solve finds the
   directions where the Gram is only rounding noise, and a map nearly singular there
   turns that noise into an objective below zero.

The aligned model keeps its architecture: no head is widened or split.
"""

from __future__ import annotations

import functools

import torch

from ...groups import Element, Group, Heads
from ...linalg import lu_inv
from ..engine.base import (
    SolveContext,
    StatTerm,
    Term,
    prefetcher,
    solve_stacked,
    solver,
    solver_many,
)
from .assignment import assign


def head_blocks(c: torch.Tensor, heads: int, dh: int) -> torch.Tensor:
    """[heads*dh, heads*dh] -> [heads, heads, dh, dh] (block (a, b))."""
    return c.reshape(heads, dh, heads, dh).permute(0, 2, 1, 3)


def _to_query(x: torch.Tensor, kv: int, gs: int) -> torch.Tensor:
    """Key/value-level blocks [K, K, ...] broadcast to query heads [H, H, ...]."""
    if gs == 1:
        return x
    rest = x.shape[2:]
    y = x[:, None, :, None].expand(kv, gs, kv, gs, *rest)
    return y.reshape(kv * gs, kv * gs, *rest)


def part_terms(group: Heads, terms: list[Term]) -> dict[str, list[tuple[Term, bool]]]:
    """part name -> [(term, is_kv_view)]."""
    out: dict[str, list[tuple[Term, bool]]] = {name: [] for name, _ in group.parts}
    for t in terms:
        kv_view = bool(t.path) and t.path[-1] == "kv"
        name = t.path[0] if t.path and t.path[0] != "kv" else ""
        out[name].append((t, kv_view))
    return out


def head_similarity(group: Heads, terms: list[Term]) -> tuple[torch.Tensor, torch.Tensor]:
    """(S [H, H], S_kv [K, K]): how well head b of B fits head a of A (larger: better)."""
    h, k = group.heads, group.kv
    sq: torch.Tensor | None = None
    skv: torch.Tensor | None = None
    for name, pts in part_terms(group, terms).items():
        if not pts:
            continue
        within = group.part(name)
        if within.is_trivial():
            # its fit is linear in the statistics (exact): summed term by term, the key/value
            # views at their own level
            for t, kv_view in pts:
                fit = within.best_fit(head_blocks(t.cross(), k if kv_view else h, within.n), _no_gram)
                if kv_view:
                    skv = fit if skv is None else skv + fit
                else:
                    sq = fit if sq is None else sq + fit
            continue
        part = _part_similarity(group, within, pts)
        sq = part + (sq if sq is not None else torch.zeros(h, h, dtype=part.dtype, device=part.device))
    if sq is None:
        sq = torch.zeros(h, h, dtype=torch.float64)
    if skv is None:
        skv = torch.zeros(k, k, dtype=sq.dtype, device=sq.device)
    return sq, skv


def _no_gram() -> torch.Tensor:
    raise AssertionError("a linear fit reads no Gram matrix")


def _part_similarity(group: Heads, within: Group, pts: list[tuple[Term, bool]]) -> torch.Tensor:
    """[H, H] for one part with a non-trivial within group. Its terms' dh x dh blocks are
    summed per variance (one sum for an orthogonal group, where co and contra coincide),
    the key/value views broadcast to the query heads. A part with both sides of a
    pairing is scored by the GL-invariant inner product of the head circuits; a
    one-sided part by its within group's best fit."""
    h, k, gs = group.heads, group.kv, group.group_size
    dh = within.n
    blocks: dict[str, torch.Tensor | None] = {"co": None, "contra": None}
    for t, kv_view in pts:
        var = "co" if within.is_orthogonal() else t.variance
        b = head_blocks(t.cross(), k if kv_view else h, dh)
        b = _to_query(b, k, gs) if kv_view else b
        prev = blocks[var]
        blocks[var] = b if prev is None else prev + b
    co, contra = blocks["co"], blocks["contra"]
    if co is not None and contra is not None:
        return (co * contra).sum((-1, -2))
    one = co if co is not None else contra
    assert one is not None
    return within.best_fit(one, functools.partial(_query_grams, group, dh, pts))


def _query_grams(group: Heads, dh: int, pts: list[tuple[Term, bool]]) -> torch.Tensor:
    """B's Gram blocks of a part's terms, [H, H, dh, dh] (they depend on head b only)."""
    h, k, gs = group.heads, group.kv, group.group_size
    total: torch.Tensor | None = None
    for t, kv_view in pts:
        g = t.gram_blocks(dh)
        g = g[None].expand(k, *g.shape) if kv_view else g[None].expand(h, *g.shape)
        g = _to_query(g, k, gs) if kv_view else g
        total = g if total is None else total + g
    assert total is not None
    return total


def assign_heads(group: Heads, sq: torch.Tensor, skv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(perm [K], qperm [K, H/K]) maximising the summed similarity (nested under GQA)."""
    k, gs = group.kv, group.group_size
    if gs == 1:
        perm = assign(sq + skv)
        return perm, torch.zeros(k, 1, dtype=torch.int64, device=perm.device)
    s4 = sq.reshape(k, gs, k, gs).permute(0, 2, 1, 3)  # [j, j', t, t']
    inner = assign(s4)  # [j, j', t]
    value = torch.gather(s4, -1, inner.unsqueeze(-1)).squeeze(-1).sum(-1)  # [j, j']
    perm = assign(value + skv)
    qperm = inner[torch.arange(k, device=perm.device), perm]
    return perm, qperm


def _gram_a_of(t: Term, dh: int, dst: torch.Tensor | None) -> torch.Tensor:
    blocks = t.gram_a_blocks(dh)
    return blocks if dst is None else blocks[dst].sum(1)


def _within_terms(group: Heads, name: str, pts: list[tuple[Term, bool]], perm: torch.Tensor,
                  qperm: torch.Tensor) -> list[Term]:
    """Statistics of the within-head problem of each new key/value head j (batch [K])."""
    h, k, gs = group.heads, group.kv, group.group_size
    dh = group.part(name).n
    out: list[Term] = []
    jj = torch.arange(k, device=perm.device)
    for t, kv_view in pts:
        if kv_view:
            c = head_blocks(t.cross(), k, dh)[jj, perm]  # [K, dh, dh]
            g = t.gram_blocks(dh)[perm]
            r = t.rows_sq().reshape(k, dh)
            ga = functools.partial(_gram_a_of, t, dh, None)
        else:
            src = perm[:, None] * gs + qperm  # [K, gs]: the old query head of new (j, t)
            dst = jj[:, None] * gs + torch.arange(gs, device=perm.device)
            c = head_blocks(t.cross(), h, dh)[dst, src].sum(1)
            g = t.gram_blocks(dh)[src].sum(1)
            r = t.rows_sq().reshape(k, gs, dh).sum(1)
            ga = functools.partial(_gram_a_of, t, dh, dst)
        out.append(StatTerm((), t.variance, c, g, r, gram_a=ga))
    return out


#: a direction of a head whose Gram eigenvalue is below this many eps (of the statistics'
#: dtype) of the Gram's trace carries nothing but rounding: it is anchored
ANCHOR_EPS = 64.0


def _anchor_terms(terms: list[Term], x_ref: torch.Tensor) -> list[Term]:
    """Terms that keep each within-head GL map X [K, dh, dh] at ``x_ref`` (the warm
    start) in the directions its data leave undetermined, one per variance present.

    Per variance, with B's summed Gram G = U diag(s) U^T and the noise floor
    tau = ANCHOR_EPS eps tr(G), the term is ||X_ref b - X b||^2 (co; for contra the
    same in X^-T and X_ref^-T) for the pseudo-data b = U diag(sqrt(max(tau - s, 0))):
    it lifts the eigenvalues below the floor (zero, or negative from rounding) to it
    and leaves every other direction as it was, so a full-rank head solves the same
    problem as before. Where the data determine X only up to a map of the undetermined
    directions (B's head rows span part of A's head: the solutions form a family), the
    anchor picks one member, invertible and no farther from ``x_ref`` than it need be;
    the objective on the data is the same for every member. The floor follows the
    statistics' dtype (float32's is 2^29 times float64's); where only one side is
    deficient, the other side's data can determine a direction the anchor pulls on, with
    a bias of the order of the floor. float32 statistics were once left unanchored, for
    fear of that bias: a float32 A planted from a lifted B with wider heads then drove the
    head maps into the undetermined directions and stayed at a relative distance of 1
    (``bench/bench_lift.py``, ``planted``); anchored, it is recovered to rounding."""
    out: list[Term] = []
    x = x_ref.to(torch.float64)
    for variance in ("co", "contra"):
        sel = [t for t in terms if t.variance == variance]
        if not sel:
            continue
        dtype = sel[0].cross().dtype
        g = torch.stack([t.gram().to(torch.float64) for t in sel]).sum(0)
        s, u = torch.linalg.eigh(g)
        tau = ANCHOR_EPS * torch.finfo(dtype).eps * torch.diagonal(g, dim1=-2, dim2=-1).sum(-1).clamp_min(0)
        lift = (tau[:, None] - s).clamp_min(0)  # [K, dh]
        if not bool((lift > 0).any()):
            continue
        ref = x if variance == "co" else lu_inv(x).mT
        b = u * lift.sqrt()[:, None, :]  # the pseudo-data: columns u_i sqrt(lift_i)
        a = ref @ b
        out.append(StatTerm((), variance, (a @ b.mT).to(dtype), (b @ b.mT).to(dtype), a.square().sum(-1).to(dtype),
                            gram_a=(a @ a.mT).to(dtype)))
    return out


@solver("Heads", cheap_apply=True)
def solve_heads(group: Group, terms: list[Term], current: Element, ctx: SolveContext) -> Element:
    return solve_heads_many(group, [(terms, current)], ctx)[0]


@solver_many("Heads")
def solve_heads_many(group: Group, problems: list[tuple[list[Term], Element]], ctx: SolveContext) -> list[Element]:
    """Head permutations space by space; the within-head problems of all spaces batched."""
    assert isinstance(group, Heads)
    perms: list[tuple[torch.Tensor, torch.Tensor]] = []
    # part -> signature -> [(problem index, within terms, warm start)]
    within: dict[str, dict[tuple[tuple[tuple[str, ...], str], ...], list[tuple[int, list[Term], Element]]]] = {}
    starts: list[dict[str, Element]] = []
    for i, (terms, current) in enumerate(problems):
        if not terms:
            perms.append((current["perm"], current["qperm"]))
            starts.append({name: group.within(current, name) for name, _ in group.parts})
            continue
        if group.permute:
            with ctx.timer("heads:similarity"):
                sq, skv = head_similarity(group, terms)
            with ctx.timer("assign"):
                perm, qperm = assign_heads(group, sq, skv)
        else:  # the heads keep their places
            perm, qperm = current["perm"], current["qperm"]
        perm = perm.to(current["perm"].device)
        qperm = qperm.to(current["qperm"].device)
        perms.append((perm, qperm))
        # warm start: the element that acted on the same old head before
        old_slot = torch.argsort(current["perm"])[perm]
        start = {name: {key: v[old_slot] for key, v in group.within(current, name).items()} for name, _ in group.parts}
        starts.append(start)
        for name, pts in part_terms(group, terms).items():
            if not pts:
                continue
            wterms = _within_terms(group, name, pts, perm, qperm)
            if group.part(name).kind == "GL":
                wterms += _anchor_terms(wterms, start[name]["matrix"])
            sig = tuple((t.path, t.variance) for t in wterms)
            within.setdefault(name, {}).setdefault(sig, []).append((i, wterms, start[name]))
    solved: list[dict[str, Element]] = [dict(s) for s in starts]
    for name, by_sig in within.items():
        wgroup = group.part(name)
        for items in by_sig.values():
            results = solve_stacked(wgroup, [(wt, st) for _, wt, st in items], ctx)
            for (i, _, _), e in zip(items, results):
                solved[i][name] = e
    return [group._assemble(perm, qperm, solved[i]) for i, (perm, qperm) in enumerate(perms)]


@prefetcher("Heads")
def prefetch_heads(group: Group, terms: list[Term]) -> None:
    """What :func:`solve_heads_many` reads of B's data: the cross-covariances, the
    diagonal blocks of the Grams and the row norms (A's Gram blocks read A only)."""
    assert isinstance(group, Heads)
    for name, pts in part_terms(group, terms).items():
        dh = group.part(name).n
        for t, _ in pts:
            t.cross()
            t.gram_blocks(dh)
            t.rows_sq()
