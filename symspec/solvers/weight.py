"""Weight matching: coordinate descent over the spaces of a :class:`~symspec.problem.Problem`.

Minimise ``sum_P w_P ||A_P - g.B_P||_F^2`` over one element per space, both state dicts
in canonical form. A round solves every space once, with all others fixed, by the solver
its group kind registers (:data:`symspec.solvers.base.SOLVERS`); rounds repeat until the
objective stops improving. The engine knows no architecture:

- B transformed by every current element is kept (``cur``); a space's terms are its
  incident segments of A and of ``cur``, with the space's own current element undone
  (on the data, or on the reduced statistics when that is cheaper);
- a parameter that no other space touches (an embedding, an unembedding) is reduced to
  its statistics once and never transformed until the end;
- spaces that share no parameter do not interact; they form one colour class of the
  schedule, and the class order puts the most connected spaces first (the residual
  stream before the heads and units that hang off it);
- two spaces acting back to back whose kinds register a joint solver (a permutation and
  the scaling right before it) are solved as one;
- the first round starts greedily (each space from the parameters whose other spaces
  are already solved), and is redone plainly should it end above the start;
- a new element is kept only if the objective over the space's parameters does not
  increase, so the reported objective is monotone by construction;
- assignments run in a thread (``lap_workers`` at once) while the next space's
  statistics are computed.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections import defaultdict, deque
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import attrs
import torch

from ..errors import SymspecInputError
from ..groups import Element, Id
from ..problem import Factor, Incidence, Problem, Segment
from .base import (
    JOINT,
    DataTerm,
    Piece,
    SolveContext,
    StatTerm,
    SumTerm,
    Term,
    Timer,
    solve_stacked,
    solver_for,
    solver_threads,
    torch_threads,
)


@attrs.frozen
class MatchEvent:
    """Progress: ``kind`` is 'start', 'space' (one solved) or 'round' (one finished)."""

    kind: str
    round: int
    rounds: int
    space: str = ""
    done: int = 0
    total: int = 0
    objective: float = math.nan


Progress = Callable[[MatchEvent], None]


@attrs.define
class WeightMatchingResult:
    elements: dict[str, Element]
    #: the objective before the first round, then after each round
    history: list[float]
    timings: dict[str, float]
    #: spaces whose element changed in the last round
    changed: list[str]
    converged: bool
    #: with ``own_b``: B transformed by ``elements`` (one entry per tie representative)
    aligned: dict[str, torch.Tensor] | None = None


def schedule(problem: Problem, spaces: list[str], covers: Mapping[str, set[str]] | None = None) -> list[list[str]]:
    """Colour classes of the spaces (two spaces interact when they share a parameter),
    the most connected first: within a class, the order of solves does not matter.
    ``covers``: a space solved together with others (a joint pair) -> all of them."""
    cover = {s: set((covers or {}).get(s, {s})) | {s} for s in spaces}
    size: dict[str, int] = defaultdict(int)
    touches: dict[str, set[str]] = defaultdict(set)
    for p in problem.params.values():
        ps = p.spaces()
        sp = {s for s in spaces if cover[s] & ps}
        numel = math.prod(p.shape)
        for s in sp:
            size[s] += numel
            touches[s] |= sp - {s}
    order = sorted(spaces, key=lambda s: (-size[s], spaces.index(s)))
    colour: dict[str, int] = {}
    for s in order:
        used = {colour[t] for t in touches[s] if t in colour}
        colour[s] = next(c for c in range(len(spaces) + 1) if c not in used)
    classes: dict[int, list[str]] = defaultdict(list)
    for s in order:
        classes[colour[s]].append(s)
    return [classes[c] for c in sorted(classes)]


def joint_pairs(problem: Problem, incidences: Mapping[str, list[Incidence]]) -> dict[str, str]:
    """outer -> inner: spaces acting back to back on one axis (``mlp[i] @ scale[i]``) whose
    kinds have a joint solver, where the outer one never acts without the inner one
    right after it, or the inner one never without the outer one right before it."""

    def right_of(inc: Incidence) -> str | None:
        f = inc.segment.factors
        return f[inc.position + 1].space if inc.position + 1 < len(f) else None

    def left_of(inc: Incidence) -> str | None:
        return inc.segment.factors[inc.position - 1].space if inc.position > 0 else None

    pairs: dict[str, str] = {}
    used: set[str] = set()
    for s in problem.spaces:
        rights = {right_of(inc) for inc in incidences.get(s, [])}
        for t in sorted(x for x in rights if x is not None and x != s):
            if s in used or t in used:
                continue
            if (problem.spaces[s].group.kind, problem.spaces[t].group.kind) not in JOINT:
                continue
            if rights == {t} or all(left_of(inc) == s for inc in incidences.get(t, [])):
                pairs[s] = t
                used |= {s, t}
    return pairs


def sqdist(a: torch.Tensor, b: torch.Tensor, chunk: int = 1 << 15) -> float:
    """||a - b||^2 accumulated in float64, in chunks: no temporaries the size of a large
    weight (fresh allocations of hundreds of MB page-fault their way in, every time), and
    each chunk's temporaries stay in the cache and under the mmap threshold that
    ``symspec match`` sets (128 KB chunks: 3x faster than 16 MB ones on a 20M-element
    pair there, the same result to 1e-11)."""
    fa, fb = a.reshape(-1), b.reshape(-1)
    if fa.numel() <= chunk:
        return float((fa - fb).square().sum(dtype=torch.float64))
    total = 0.0
    for i in range(0, fa.numel(), chunk):
        d = fa[i : i + chunk] - fb[i : i + chunk]
        total += float(d.square().sum(dtype=torch.float64))
    return total


#: storage precisions that are matched in float32: CPU linear algebra has no float16 or
#: bfloat16 SVD, and their 3-digit rounding would be the objective's floor
LOW_PRECISION = (torch.float16, torch.bfloat16)


def working_dtype(dtype: torch.dtype) -> torch.dtype:
    """The precision weights stored in ``dtype`` are matched in: float32 for float16 and
    bfloat16 (the result is cast back for writing), else ``dtype`` itself.

    >>> working_dtype(torch.bfloat16), working_dtype(torch.float64)
    (torch.float32, torch.float64)
    """
    return torch.float32 if dtype in LOW_PRECISION else dtype


def widen(sd: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``sd`` with its float16/bfloat16 entries in float32 (the others as they are), to be
    canonicalised and matched in float32."""
    return {k: (v.float() if v.dtype in LOW_PRECISION else v) for k, v in sd.items()}


def sqnorm(x: torch.Tensor, chunk: int = 1 << 15) -> float:
    """||x||^2 accumulated in float64, in chunks (see :func:`sqdist`)."""
    fx = x.reshape(-1)
    return math.fsum(float(fx[i : i + chunk].square().sum(dtype=torch.float64)) for i in range(0, fx.numel(), chunk))


#: The rounding level of the objective (docs/matching.md, "Precision"). Two values of
#: one parameter's objective are told apart only when they differ by more than both
#: their levels together: what the working precision leaves of the difference itself
#: (``EVAL_ROUNDING`` eps of the value: the difference of two stored weights and its
#: square are rounded once each) plus what it leaves of the stored transformed weights:
#: a product of width n rounds every entry by about sqrt(n) eps of its size, so the
#: weights of B move by ``u = STATE_ROUNDING eps sqrt(width) ||B||`` (width summed over
#: the parameter's axes) and the objective by ``2 sqrt(v) u / sqrt(numel)`` (random
#: signs) plus ``u^2``: the floor a planted pair ends on. Measured on planted float32
#: pairs (d 16 to 64): 17 to 490 eps^2 ||B||^2, where a decision needs more than
#: 2 u^2 = 2 (d + d) eps^2 ||B||^2 per square weight; STATE_ROUNDING 4 stopped them 10x
#: above that floor, with real gains left.
EVAL_ROUNDING = 2.0
STATE_ROUNDING = 1.0

#: bytes of one float64 block of a static term's exact statistics: the data is
#: converted a block of columns at a time, never a float64 copy of a whole embedding
EXACT_BLOCK_BYTES = 1 << 24


@attrs.frozen
class _Exact:
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


def _exact_stats(a: torch.Tensor, b: torch.Tensor, w: float) -> _Exact:
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
    return _Exact(w * cross, w * gram, w * rows, m)


def _weighted_gram(x: torch.Tensor, w: float) -> torch.Tensor:
    return w * (x @ x.mT)


def _row_norms_sq(x: torch.Tensor) -> torch.Tensor:
    """sum of squares per row, without a temporary the size of ``x`` (an embedding's)."""
    return torch.linalg.vector_norm(x, dim=-1).square()


def _undo_chain(steps: tuple[tuple[Any, Element, tuple[str, ...], str], ...], x: torch.Tensor) -> torch.Tensor:
    """Apply inverse elements one after the other (outer space first, then its partner)."""
    for group, element, path, variance in steps:
        x = group.apply(element, x, path, variance)
    return x


class _Engine:
    def __init__(self, problem: Problem, sd_a: Mapping[str, torch.Tensor], sd_b: Mapping[str, torch.Tensor],
                 ctx: SolveContext, init: Mapping[str, Element] | None, own_b: bool = False) -> None:
        self.problem = problem
        self.ctx = ctx
        dev, dt = ctx.device, ctx.dtype
        # one representative per tie group, weighted by the number of names sharing it
        tie_of = {n: g for g in problem.ties for n in g}
        self.weight: dict[str, float] = {}
        for name in problem.params:
            group = tie_of.get(name, (name,))
            rep = next(n for n in group if n in problem.params)
            self.weight[rep] = self.weight.get(rep, 0.0) + 1.0
        self.a = {p: sd_a[p].detach().to(device=dev, dtype=dt) for p in self.weight}
        self.b0 = {p: sd_b[p].detach().to(device=dev, dtype=dt) for p in self.weight}
        self.elements: dict[str, Element] = {}
        for name, si in problem.spaces.items():
            e = init.get(name) if init else None
            self.elements[name] = si.group.to(e, dtype=dt, device=dev) if e is not None else si.group.identity(dtype=dt, device=dev)
        self.incidences: dict[str, list[Incidence]] = defaultdict(list)
        for name in problem.spaces:
            for inc in problem.incidences(name):
                if inc.param in self.weight:
                    self.incidences[name].append(inc)
        self.pairs = joint_pairs(problem, self.incidences)
        # parameters acted on by a single space, along one axis, one factor per segment:
        # their terms never change, so they are reduced once -- where the n x n statistics
        # are no larger than the data (an embedding, not a bias: a bias of n units would
        # keep a rank-one n x n matrix for the whole run)
        self.static: dict[str, str] = {}
        for p in self.weight:
            pb = problem.params[p]
            sp = pb.spaces()
            if len(sp) == 1 and len(pb.axes) == 1 and all(len(seg.factors) == 1 for seg in pb.axes[0].segments):
                numel = math.prod(pb.shape)
                if all(seg.size * seg.size <= numel // pb.shape[pb.axes[0].axis] * seg.size for seg in pb.axes[0].segments):
                    self.static[p] = next(iter(sp))
        self.static_terms: dict[Incidence, StatTerm] = {}
        # static terms whose objective comes from float64 statistics: a dense action in a
        # working precision coarser than float64. A cheap action (a permutation) acts on
        # the data instead, and so does a float64 one: there the statistics' cancellation
        # (eps64 of ||a||^2) would exceed the float64 rounding of the distance itself.
        self.exact: dict[Incidence, _Exact] = {}
        self.eps = torch.finfo(dt).eps
        with ctx.timer("stats"):
            for p, s in self.static.items():
                exact = not solver_for(problem.spaces[s].group).cheap_apply and self.eps > torch.finfo(torch.float64).eps
                for inc in self._incs_of(p, s):
                    a = self._segment(self.a[p], inc)
                    b = self._segment(self.b0[p], inc)
                    w = self.weight[p]
                    if exact:
                        ex = self.exact[inc] = _exact_stats(a, b, w)
                        self.static_terms[inc] = StatTerm(
                            inc.factor.path, inc.factor.variance, ex.cross.to(dt), ex.gram.to(dt), ex.rows_sq.to(dt),
                            gram_a=functools.partial(_weighted_gram, a, w))
                        continue
                    self.static_terms[inc] = StatTerm(
                        inc.factor.path, inc.factor.variance, w * (a @ b.mT),
                        functools.partial(_weighted_gram, b, w), w * _row_norms_sq(a),
                        gram_a=functools.partial(_weighted_gram, a, w))
        # what the rounding level of each parameter's objective is made of (see
        # STATE_ROUNDING): B's squared norm (weight included; no space changes it much)
        # times the widths of the products acting on the parameter, and its size
        self.state_sq: dict[str, float] = {}
        self.numel: dict[str, int] = {}
        for p in self.weight:
            pb = problem.params[p]
            width = sum(max(seg.size for seg in ab.segments) for ab in pb.axes) or 1
            self.state_sq[p] = (STATE_ROUNDING * self.eps) ** 2 * width * self.weight[p] * sqnorm(self.b0[p])
            self.numel[p] = max(1, math.prod(pb.shape))

        self.cur: dict[str, torch.Tensor] = {}
        self.obj: dict[str, float] = {}
        #: the error of computing ``obj`` (of its rounding level, the part that is not
        #: the stored weights' own rounding)
        self.err: dict[str, float] = {}
        if own_b:
            # B's tensors become the working copy (transformed as we go, never in place):
            # no second copy of B. The caller's dict gives them up (see match_weights).
            assert isinstance(sd_b, dict)
            with ctx.timer("apply"):
                for p in self.weight:
                    if p in self.static:
                        continue
                    x = self.b0.pop(p)
                    sd_b.pop(p, None)
                    self.cur[p] = x if init is None else self._transform(p, x, self.elements)
            self._objectives()
        else:
            self.load(self.elements)

    def load(self, elements: Mapping[str, Element]) -> None:
        """Set every element, and B transformed by them."""
        if any(p not in self.b0 for p in self.weight):
            self.move_to(elements)
            return
        self.elements = dict(elements)
        self.cur.clear()
        with self.ctx.timer("apply"):
            for p in self.weight:
                if p not in self.static:
                    self.cur[p] = self._transform(p, self.b0[p], self.elements)
        self._objectives()

    def move_to(self, elements: Mapping[str, Element]) -> None:
        """Act on the working copy until it holds B transformed by ``elements`` (when B
        itself was not kept): each space's change, conjugated by the factors after it."""
        with self.ctx.timer("apply"):
            for s, target in elements.items():
                group = self.problem.spaces[s].group
                if all(torch.equal(target[k], self.elements[s][k]) for k in target):
                    continue
                delta = group.compose(target, group.inverse(self.elements[s]))
                for p in dict.fromkeys(inc.param for inc in self.incidences[s]):
                    if p not in self.static:
                        self.cur[p] = self._transform(p, self.cur[p], {s: delta}, only=s)
                self.elements[s] = target
        self._objectives()

    def _objectives(self) -> None:
        with self.ctx.timer("objective"):
            for p in self.weight:
                self.obj[p], self.err[p] = self._objective(p, self.elements)

    def aligned(self) -> dict[str, torch.Tensor]:
        """B transformed by the current elements, one entry per tie representative."""
        out = dict(self.cur)
        with self.ctx.timer("apply"):
            for p in self.static:
                out[p] = self._transform(p, self.b0[p], self.elements)
        return out

    # -- data access ---------------------------------------------------------------------
    def _incs_of(self, p: str, s: str) -> list[Incidence]:
        return [inc for inc in self.incidences[s] if inc.param == p]

    def _left(self, seg: Segment, pos: int) -> tuple[Factor, ...]:
        return seg.factors[:pos]

    def _undo_left(self, y: torch.Tensor, left: tuple[Factor, ...], elements: Mapping[str, Element]) -> torch.Tensor:
        for f in left:
            g = self.problem.spaces[f.space].group
            y = g.apply(g.inverse(elements[f.space]), y, f.path, f.variance)  # type: ignore[arg-type]
        return y

    def _redo_left(self, y: torch.Tensor, left: tuple[Factor, ...], elements: Mapping[str, Element]) -> torch.Tensor:
        for f in reversed(left):
            g = self.problem.spaces[f.space].group
            y = g.apply(elements[f.space], y, f.path, f.variance)  # type: ignore[arg-type]
        return y

    def _segment(self, x: torch.Tensor, inc: Incidence) -> torch.Tensor:
        """The incidence's segment of ``x``, moved to the front, factors acting after the
        space undone, flattened to [n, m]."""
        y = inc.take(x.movedim(inc.axis, 0))
        y = self._undo_left(y, self._left(inc.segment, inc.position), self.elements)
        return y.reshape(inc.segment.size, -1)

    def _transform(self, p: str, x: torch.Tensor, elements: Mapping[str, Element], only: str | None = None) -> torch.Tensor:
        """Apply ``elements`` to parameter ``p`` (``only``: just that space's factors, each
        conjugated by the factors acting after it)."""
        pb = self.problem.params[p]
        for ab in pb.axes:
            if only is not None and not any(f.space == only for seg in ab.segments for f in seg.factors):
                continue
            moved = x.movedim(ab.axis, 0)
            if ab.layout is not None:  # a head-major axis: act in the concatenated order
                moved = ab.layout.to_concat(moved)
            pieces = []
            for seg in ab.segments:
                y = moved[seg.start : seg.stop]
                if only is None:
                    for f in reversed(seg.factors):
                        g = self.problem.spaces[f.space].group
                        y = g.apply(elements[f.space], y, f.path, f.variance)  # type: ignore[arg-type]
                else:
                    for pos, f in enumerate(seg.factors):
                        if f.space != only:
                            continue
                        left = self._left(seg, pos)
                        y = self._undo_left(y, left, self.elements)
                        g = self.problem.spaces[f.space].group
                        y = g.apply(elements[only], y, f.path, f.variance)  # type: ignore[arg-type]
                        y = self._redo_left(y, left, self.elements)
                pieces.append(y)
            moved = pieces[0] if len(pieces) == 1 else torch.cat(pieces, 0)
            if ab.layout is not None:
                moved = ab.layout.to_storage(moved)
            x = moved.movedim(0, ab.axis)
        return x

    def _static_objective(self, p: str, elements: Mapping[str, Element]) -> tuple[float, float]:
        s = self.static[p]
        incs = self._incs_of(p, s)
        if not all(inc in self.exact for inc in incs):
            # acting on the data costs about what the data does for a cheap action (a
            # head group's n x n matrix is block-permuted, with per-head inverses), and
            # in float64 only the distance itself is exact to the distance's precision
            x = self._transform(p, self.b0[p], {s: elements[s]})
            v = self.weight[p] * sqdist(self.a[p], x)
            return v, EVAL_ROUNDING * torch.finfo(x.dtype).eps * v
        group = self.problem.spaces[s].group
        total = err = 0.0
        eps64 = torch.finfo(torch.float64).eps
        for inc in incs:
            ex = self.exact[inc]
            t = self.static_terms[inc]
            f = group.matrix(elements[s], t.path, t.variance).to(torch.float64)  # type: ignore[arg-type]
            # ||F b||^2 = <F G, F> in full: F in a float32 group is orthogonal only to
            # ~1e-7, so ||b||^2 in its place is off by far more than a planted pair's
            # whole objective
            lin = float((f * ex.cross).sum())
            quad = float(((f @ ex.gram) * f).sum())
            a_sq = ex.a_sq
            total += a_sq - 2 * lin + quad
            # float64 sums of ``length`` products per statistic, then of n^2 entries
            n = f.shape[-1]
            err += math.sqrt(ex.length + n * n) * eps64 * (a_sq + 2 * abs(lin) + quad)
        # exact up to ``err``: a sum of squares below it is zero within its precision
        return max(total, 0.0), err

    def _objective(self, p: str, elements: Mapping[str, Element], cur: torch.Tensor | None = None) -> tuple[float, float]:
        """Parameter ``p``'s objective and the error of computing it."""
        if p in self.static:
            return self._static_objective(p, elements)
        x = self.cur[p] if cur is None else cur
        v = self.weight[p] * sqdist(self.a[p], x)
        return v, EVAL_ROUNDING * torch.finfo(x.dtype).eps * v

    def level(self, p: str, value: float, err: float) -> float:
        """The rounding level of parameter ``p``'s objective ``value`` (computed with
        error ``err``): a change smaller than it is rounding noise (see STATE_ROUNDING)."""
        u2 = self.state_sq[p]
        return err + 2.0 * math.sqrt(max(value, 0.0) * u2 / self.numel[p]) + u2

    def total(self) -> float:
        return math.fsum(self.obj.values())

    def total_level(self) -> float:
        """The rounding level of :meth:`total`."""
        return math.fsum(self.level(p, v, self.err[p]) for p, v in self.obj.items())

    # -- one space -------------------------------------------------------------------------
    def terms(self, s: str, trusted: set[str] | None = None) -> list[Term]:
        """The terms of space ``s`` (and of its joint partner, when it has one). With
        ``trusted``, only parameters whose other spaces are all trusted (if any is)."""
        inner = self.pairs.get(s)
        unit = {s} if inner is None else {s, inner}
        group = self.problem.spaces[s].group
        entry = solver_for(group)
        inv = {u: self.problem.spaces[u].group.inverse(self.elements[u]) for u in unit}
        pieces: dict[tuple[Any, ...], list[Piece]] = defaultdict(list)
        static: dict[tuple[Any, ...], list[Term]] = defaultdict(list)
        undo: dict[tuple[Any, ...], Any] = {}
        incs: list[tuple[Incidence, str, str | None]] = []
        for inc in self.incidences[s]:
            f = inc.segment.factors
            nxt = f[inc.position + 1] if inc.position + 1 < len(f) else None
            if inner is not None and nxt is not None and nxt.space == inner:
                incs.append((inc, "pair", nxt.variance))
            else:
                incs.append((inc, "outer", None))
        if inner is not None:
            for inc in self.incidences[inner]:
                if not (inc.position > 0 and inc.segment.factors[inc.position - 1].space == s):
                    incs.append((inc, "inner", None))
        if trusted is not None:
            keep = [x for x in incs if self.problem.params[x[0].param].spaces() - unit <= trusted]
            incs = keep or incs
        merge = entry.variance_free and inner is None
        for inc, role, inner_var in incs:
            # a kind that acts alike for every variance: one term (one product) for all
            key = (inc.factor.path, "co" if merge else inc.factor.variance, role, inner_var)
            if inc.param in self.static:  # one space: never a pair
                term: Term = self.static_terms[inc]
                if role != term.role:
                    term = SumTerm([term])
                    term.role = role
                static[key].append(term)
                continue
            a = self._segment(self.a[inc.param], inc)
            c = self._segment(self.cur[inc.param], inc)
            pieces[key].append(Piece(a, c, self.weight[inc.param]))
            if key not in undo:
                steps = [(self.problem.spaces[inc.factor.space].group, inv[inc.factor.space], inc.factor.path, inc.factor.variance)]
                if role == "pair":
                    nxt = inc.segment.factors[inc.position + 1]
                    steps.append((self.problem.spaces[inner].group, inv[inner], nxt.path, nxt.variance))  # type: ignore[index]
                undo[key] = functools.partial(_undo_chain, tuple(steps))
        out: list[Term] = []
        for key in dict.fromkeys([*pieces, *static]):
            path, var, role, inner_var = key
            parts: list[Term] = list(static.get(key, []))
            if key in pieces:
                ps = pieces[key]
                n = ps[0].a.shape[0]
                wide = sum(p.a.shape[1] for p in ps) > n
                parts.append(DataTerm(path, var, ps, undo[key], fold=wide and not entry.cheap_apply and role == "outer",
                                      role=role, inner_variance=inner_var))
            out.append(parts[0] if len(parts) == 1 else SumTerm(parts))
        return out

    def solve_class(self, spaces: list[str], on_done: Callable[[str], None], trusted: set[str] | None = None) -> list[str]:
        """Solve spaces that share no parameter; returns those whose element changed.

        ``trusted`` (the first round's greedy start): use only the parameters whose other
        spaces are already solved, and keep every solution (the caller checks the round).

        Groups solved in one batched call (the head groups of all layers) get their
        statistics first; on a machine with few cores (see :meth:`_overlap`) that call
        then runs in a worker thread beside the assignment pipeline of the other groups
        (the FF spaces), everything single-threaded, instead of after it with a core
        idle. Spaces of a class share no parameter, so the order in which their
        solutions are accepted does not change the result.
        """
        by_group: dict[Any, list[str]] = defaultdict(list)
        changed: list[str] = []
        for s in spaces:
            if s in self.pairs:
                changed += self._solve_pair(s, on_done, trusted)
            else:
                by_group[self.problem.spaces[s].group].append(s)
        batched: list[tuple[Any, list[str]]] = []
        piped: list[tuple[Any, list[str]]] = []
        for group, names in by_group.items():
            entry = solver_for(group)
            many = entry.solve_many is not None or (entry.batched and len(names) > 1)
            (batched if many else piped).append((group, names))
        background = bool(piped) and self._overlap()
        workers = max(1, self.ctx.lap_workers) + (len(batched) if background else 0)
        full = torch.get_num_threads()
        later: list[tuple[list[str], Future[list[Element]]]] = []
        with ThreadPoolExecutor(max_workers=workers) as pool, contextlib.ExitStack() as low:
            for group, names in batched:
                problems = [(self.terms(s, trusted), self.elements[s]) for s in names]
                with self._step_threads(later, full), self.ctx.timer("stats"):
                    for ts, _ in problems:
                        for t in ts:
                            t.cross()
                    # the solve runs while the pipeline's statistics take memory: keep
                    # only the statistics it reads, not the transformed data behind them
                    entry = solver_for(group)
                    if background and entry.prefetch is not None:
                        for ts, _ in problems:
                            entry.prefetch(group, ts)
                            for t in ts:
                                t.evict()
                if background:
                    if not later:
                        # from here until every background solve is done, torch runs with
                        # the solvers' own threads except for steps taken once they are
                        # (_step_threads): their small ops always see one thread count,
                        # so the result does not depend on timing
                        low.enter_context(torch_threads(self.ctx.threads))
                    later.append((names, pool.submit(self._solve_batched, group, problems, False)))
                else:
                    changed += self._accept_each(names, self._solve_batched(group, problems, True), on_done, trusted)
                del problems
            for group, names in piped:
                changed += self._solve_pipelined(group, names, on_done, trusted, pool, later, full)
            for names, fut in later:
                news = fut.result()
                with self._step_threads(later, full):
                    changed += self._accept_each(names, news, on_done, trusted)
        return changed

    def _step_threads(self, background: list[tuple[list[str], Future[list[Element]]]],
                      full: int) -> contextlib.AbstractContextManager[None]:
        """Torch threads for a step on this thread: all of them (``full``) once nothing
        runs in the background any more, else the count set for the background section."""
        return torch_threads(full) if all(f.done() for _, f in background) else contextlib.nullcontext()

    def _overlap(self) -> bool:
        """Whether batched solves run beside the assignment pipeline: on the CPU, when
        torch's threads are at most the solvers' own plus one (2 cores: the statistics'
        products and the within-head solves each get one). With more cores the products
        keep them all and the solves run after, as small threaded LAPACK calls beside
        busy threads are many times slower (see :func:`solver_threads`)."""
        c = self.ctx
        return c.overlap and c.device.type == "cpu" and c.threads > 0 and torch.get_num_threads() <= c.threads + 1

    def _solve_batched(self, group: Any, problems: list[tuple[list[Term], Element]], own_threads: bool) -> list[Element]:
        entry = solver_for(group)
        threads = solver_threads(self.ctx.device, self.ctx.threads) if own_threads else contextlib.nullcontext()
        with self.ctx.timer(f"solve:{group.kind}"), threads:
            if entry.solve_many is not None:
                return entry.solve_many(group, problems, self.ctx)
            return self._solve_stacked(group, problems)

    def _accept_each(self, names: list[str], news: list[Element], on_done: Callable[[str], None],
                     trusted: set[str] | None) -> list[str]:
        changed = []
        for s, new in zip(names, news):
            if self.accept({s: new}, force=trusted is not None):
                changed.append(s)
            on_done(s)
        return changed

    def _solve_pipelined(self, group: Any, names: list[str], on_done: Callable[[str], None],
                         trusted: set[str] | None, pool: ThreadPoolExecutor,
                         background: list[tuple[list[str], Future[list[Element]]]], full: int) -> list[str]:
        """Spaces of one class and group, one at a time: statistics on this thread (large
        products, threaded by torch), solves in ``pool`` (``lap_workers`` at a time;
        scipy's assignments release the GIL), so the next space's statistics are
        computed while up to ``lap_workers`` assignments run. Spaces of a class share no
        parameter, so none of this touches the same tensors; solutions are accepted
        here, in order, and at most ``lap_workers`` spaces' statistics wait at once
        (memory stays bounded). While a batched solve of the class runs in ``background``,
        the products leave it its core (torch's threads stay at the solvers' own, see
        :meth:`solve_class`); once it is done they get all ``full`` threads again."""
        entry = solver_for(group)
        timer = self.ctx.timer
        workers = max(1, self.ctx.lap_workers)
        changed: list[str] = []
        pending: deque[tuple[str, Future[Element] | None]] = deque()

        def run(terms: list[Term], current: Element) -> Element:
            with timer(f"solve:{group.kind}"):
                return entry.solve(group, terms, current, self.ctx)

        def settle(limit: int) -> None:
            while len(pending) > limit:
                s, fut = pending.popleft()
                if fut is not None and self.accept({s: fut.result()}, force=trusted is not None):
                    changed.append(s)
                on_done(s)

        for s in names:
            with self._step_threads(background, full):
                terms = self._prepare(s, trusted)
                pending.append((s, pool.submit(run, terms, self.elements[s]) if terms else None))
                del terms
                settle(workers)
        with self._step_threads(background, full):
            settle(0)
        return changed

    def _prepare(self, s: str, trusted: set[str] | None) -> list[Term]:
        terms = self.terms(s, trusted)
        with self.ctx.timer("stats"):
            for t in terms:
                t.cross()
        return terms

    def _solve_pair(self, s: str, on_done: Callable[[str], None], trusted: set[str] | None) -> list[str]:
        t = self.pairs[s]
        gs, gt = self.problem.spaces[s].group, self.problem.spaces[t].group
        terms = self.terms(s, trusted)
        changed: list[str] = []
        if terms:
            with self.ctx.timer("stats"):
                for term in terms:
                    term.cross()
            with self.ctx.timer(f"solve:{gs.kind}+{gt.kind}"), solver_threads(self.ctx.device, self.ctx.threads):
                new_s, new_t = JOINT[(gs.kind, gt.kind)](gs, gt, terms, (self.elements[s], self.elements[t]), self.ctx)
            del terms
            if self.accept({t: new_t, s: new_s}, force=trusted is not None):
                changed = [s, t]
        on_done(s)
        on_done(t)
        return changed

    def _solve_stacked(self, group: Any, problems: list[tuple[list[Term], Element]]) -> list[Element]:
        by_sig: dict[Any, list[int]] = defaultdict(list)
        for i, (ts, _) in enumerate(problems):
            by_sig[tuple((t.path, t.variance) for t in ts)].append(i)
        out: list[Element | None] = [None] * len(problems)
        for idx in by_sig.values():
            for i, e in zip(idx, solve_stacked(group, [problems[i] for i in idx], self.ctx)):
                out[i] = e
        return out  # type: ignore[return-value]

    def accept(self, news: Mapping[str, Element], force: bool = False) -> bool:
        """Keep the new elements (a space, or a joint pair: inner space first) if they
        lower the objective over their parameters by more than its rounding level (or
        ``force``): a change within rounding noise is not taken, so it neither moves the
        weights nor counts as progress."""
        deltas: dict[str, Element] = {}
        for s, new in news.items():
            group = self.problem.spaces[s].group
            old = self.elements[s]
            # the same fields (not group.equal, which builds every action matrix)
            if not all(torch.equal(new[k], old[k].to(new[k].device)) for k in old):
                deltas[s] = group.compose(new, group.inverse(old))
        if not deltas:
            return False
        params = list(dict.fromkeys(inc.param for s in news for inc in self.incidences[s]))
        saved = dict(self.elements)
        trial: dict[str, torch.Tensor] = {}
        with self.ctx.timer("apply"):
            for s, delta in deltas.items():
                for p in dict.fromkeys(inc.param for inc in self.incidences[s]):
                    if p not in self.static:
                        trial[p] = self._transform(p, trial.get(p, self.cur[p]), {s: delta}, only=s)
                # the next space's factors are conjugated by this one's new element
                self.elements[s] = news[s]
        elems = dict(self.elements)
        self.elements = saved
        with self.ctx.timer("objective"):
            before = math.fsum(self.obj[p] for p in params)
            after = {p: (self._objective(p, elems) if p in self.static else self._objective(p, elems, trial.get(p, self.cur[p]))) for p in params}
            noise = math.fsum(self.level(p, self.obj[p], self.err[p]) + self.level(p, *after[p]) for p in params)
        if not force and not before - math.fsum(v for v, _ in after.values()) > noise:
            return False
        self.cur.update(trial)
        for p, (v, e) in after.items():
            self.obj[p], self.err[p] = v, e
        self.elements = elems
        return True


def match_weights(problem: Problem, sd_a: Mapping[str, torch.Tensor], sd_b: Mapping[str, torch.Tensor], *,
                  rounds: int = 10, tol: float = 1e-6, device: str | torch.device = "cpu",
                  dtype: torch.dtype | None = None, init: Mapping[str, Element] | None = None,
                  progress: Progress | None = None, max_iter: int = 5, greedy_start: bool = True,
                  timer: Timer | None = None, own_b: bool = False, lap_workers: int = 1,
                  overlap: bool = True) -> WeightMatchingResult:
    """Coordinate descent for ``min_g sum_P ||A_P - g.B_P||^2`` (both in canonical form).

    ``rounds``: at most this many rounds; stop earlier once a round improves the
    objective by less than ``tol`` (relative). ``greedy_start``: the first round solves
    each space from the parameters whose other spaces are already solved (kept only if
    that round ends below the starting objective). ``max_iter``: Gauss-Newton steps per
    GL solve. ``dtype``: the working precision (default: A's, float32 for float16 and
    bfloat16). ``lap_workers``: assignments of one schedule class solved at once (threads).
    ``overlap``: batched solves may run beside the statistics (see ``_Engine._overlap``).
    Spaces whose group is ``Id`` are not searched. Elements come back in
    ``problem``'s groups, on ``device``.

    ``own_b``: ``sd_b`` is a dict the solver may take tensors out of: B's bound tensors
    become the working copy instead of being copied (for large models: one copy of B
    less), and the result carries B transformed (``aligned``), accumulated round by round
    (equal to applying ``elements`` to B up to rounding).
    """
    if rounds < 0:
        raise SymspecInputError(f"rounds must be >= 0, got {rounds}")
    missing = [p for p in problem.params if p not in sd_a or p not in sd_b]
    if missing:
        raise SymspecInputError(f"parameter(s) missing from a state dict: {', '.join(missing[:5])}")
    ref = next((sd_a[p] for p in problem.params), None)
    dt = dtype or (working_dtype(ref.dtype) if ref is not None and ref.is_floating_point() else torch.float64)
    if lap_workers < 1:
        raise SymspecInputError(f"lap_workers must be >= 1, got {lap_workers}")
    ctx = SolveContext(device=torch.device(device), dtype=dt, timer=timer or Timer(), max_iter=max_iter,
                       lap_workers=lap_workers, overlap=overlap)
    engine = _Engine(problem, sd_a, sd_b, ctx, init, own_b=own_b)
    searched = [s for s, si in problem.spaces.items() if not isinstance(si.group, Id) and engine.incidences[s]]
    engine.pairs = {s: t for s, t in engine.pairs.items() if s in searched and t in searched}
    for s in searched:
        solver_for(problem.spaces[s].group)  # fail early for kinds without a solver
    inner = set(engine.pairs.values())
    units = [s for s in searched if s not in inner]
    classes = schedule(problem, units, {s: {s, t} for s, t in engine.pairs.items()})
    history = [engine.total()]
    levels = [engine.total_level()]
    say = progress or (lambda e: None)
    say(MatchEvent("start", 0, rounds, total=len(searched), objective=history[0]))
    changed: list[str] = []
    converged = False
    start = dict(engine.elements)
    for r in range(1, rounds + 1):
        # The first round starts greedily: each space is solved from the parameters whose
        # other spaces it already has (an embedding before any layer has been aligned).
        # Should that end above the start, the round is redone the plain way.
        for greedy in ((True, False) if r == 1 and greedy_start else (False,)):
            changed = []
            done = 0

            def on_done(s: str, r: int = r) -> None:
                nonlocal done
                done += 1
                say(MatchEvent("space", r, rounds, s, done, len(searched), engine.total()))

            trusted: set[str] | None = set() if greedy else None
            for cls in classes:
                changed += engine.solve_class(cls, on_done, trusted)
                if trusted is not None:
                    trusted |= set(cls)
            if not greedy or engine.total() <= history[0]:
                break
            engine.load(start)
        history.append(engine.total())
        levels.append(engine.total_level())
        say(MatchEvent("round", r, rounds, done=done, total=len(searched), objective=history[-1]))
        prev, now = history[-2], history[-1]
        # a gain within the rounding level of the two values is no gain, whatever ``tol``
        if not changed or prev - now <= max(tol * abs(prev), levels[-2] + levels[-1], 1e-300):
            converged = True
            break
    aligned = engine.aligned() if own_b else None
    return WeightMatchingResult(engine.elements, history, ctx.timer.as_dict(), changed, converged, aligned)
