"""The weights' statistics: a :class:`~.statistics.StatisticsProvider` that reads two
state dicts, for ``min_g sum_P w_P ||A_P - g.B_P||_F^2`` (both in canonical form).

- B transformed by every current element is kept (``cur``); a space's terms are its
  incident segments of A and of ``cur``, with the space's own current element undone
  (on the data, or on the reduced statistics when that is cheaper);
- a parameter that no other space touches (an embedding, an unembedding) is reduced to
  its statistics once and never transformed until the end (in float64 where its group
  acts densely in a coarser working precision, :mod:`.rounding`);
- tied parameters count once, weighted by the number of names sharing the tensor;
- each parameter's objective carries its rounding level (:func:`.rounding.rounding_level`).
"""

from __future__ import annotations

import functools
import math
from collections import defaultdict
from collections.abc import Mapping, Set
from typing import Any

import torch

from ...groups import Element
from ...problem import Incidence, Problem
from .acting import segment, transform, transform_in_place
from .base import JOINT, DataTerm, Piece, SolveContext, StatTerm, SumTerm, Term, solver_for
from .rounding import (
    EVAL_ROUNDING,
    ExactStats,
    exact_stats,
    rounding_level,
    sqdist,
    sqnorm,
    state_rounding_sq,
)
from .statistics import Trial, Value, same_element


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


def initial_elements(problem: Problem, init: Mapping[str, Element] | None, dtype: torch.dtype,
                     device: torch.device) -> dict[str, Element]:
    """Every space's starting element: ``init``'s (None or a space left out: the
    identity), in ``dtype`` on ``device``."""
    out: dict[str, Element] = {}
    for name, si in problem.spaces.items():
        e = init.get(name) if init else None
        out[name] = si.group.to(e, dtype=dtype, device=device) if e is not None else si.group.identity(dtype=dtype, device=device)
    return out


def incidence_roles(incidences: Mapping[str, list[Incidence]], space: str,
                    partner: str | None) -> list[tuple[Incidence, str, str | None]]:
    """Every incidence of ``space`` (and of its ``partner``) with its role in the pair
    and, for ``pair`` terms, the inner space's variance."""
    incs: list[tuple[Incidence, str, str | None]] = []
    for inc in incidences.get(space, []):
        f = inc.segment.factors
        nxt = f[inc.position + 1] if inc.position + 1 < len(f) else None
        if partner is not None and nxt is not None and nxt.space == partner:
            incs.append((inc, "pair", nxt.variance))
        else:
            incs.append((inc, "outer", None))
    if partner is not None:
        for inc in incidences.get(partner, []):
            if not (inc.position > 0 and inc.segment.factors[inc.position - 1].space == space):
                incs.append((inc, "inner", None))
    return incs


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


def _tie_weights(problem: Problem) -> dict[str, float]:
    """One representative per tie group, weighted by the number of names sharing it."""
    tie_of = {n: g for g in problem.ties for n in g}
    weight: dict[str, float] = {}
    for name in problem.params:
        group = tie_of.get(name, (name,))
        rep = next(n for n in group if n in problem.params)
        weight[rep] = weight.get(rep, 0.0) + 1.0
    return weight


def _static_params(problem: Problem, params: Mapping[str, float]) -> dict[str, str]:
    """Parameters acted on by a single space, along one axis, one factor per segment ->
    that space: their terms never change, so they are reduced once -- where the n x n
    statistics are no larger than the data (an embedding, not a bias: a bias of n units
    would keep a rank-one n x n matrix for the whole run)."""
    static: dict[str, str] = {}
    for p in params:
        pb = problem.params[p]
        sp = pb.spaces()
        if len(sp) == 1 and len(pb.axes) == 1 and all(len(seg.factors) == 1 for seg in pb.axes[0].segments):
            numel = math.prod(pb.shape)
            if all(seg.size * seg.size <= numel // pb.shape[pb.axes[0].axis] * seg.size for seg in pb.axes[0].segments):
                static[p] = next(iter(sp))
    return static


class WeightStatistics:
    """The statistics of ``sum_P w_P ||A_P - g.B_P||^2`` from the state dicts ``sd_a`` and
    ``sd_b`` (see the module), at ``init`` (None or a space left out: the identity).

    ``own_b``: ``sd_b`` is a dict this object may take tensors out of: B's bound tensors
    become the working copy instead of being copied (one copy of B less), transformed as
    the elements change (never in place); :meth:`aligned` returns them. ``trial_bytes``:
    how much of B's transformed parameters a tried change keeps for when it is taken
    (:meth:`evaluate`).
    """

    def __init__(self, problem: Problem, sd_a: Mapping[str, torch.Tensor], sd_b: Mapping[str, torch.Tensor],
                 ctx: SolveContext, init: Mapping[str, Element] | None = None, own_b: bool = False,
                 trial_bytes: float = math.inf) -> None:
        self.problem = problem
        self.ctx = ctx
        self.trial_bytes = trial_bytes
        #: static parameters of B this object holds alone (own_b): aligned() may overwrite them
        self.owned_static: set[str] = set()
        dev, dt = ctx.device, ctx.dtype
        self.weight = _tie_weights(problem)
        # bound tensors as their axes see them (a view merges stored axes); aligned()
        # gives them back stored
        self.a = {p: problem.params[p].viewed(sd_a[p].detach().to(device=dev, dtype=dt)) for p in self.weight}
        self.b0 = {p: problem.params[p].viewed(sd_b[p].detach().to(device=dev, dtype=dt)) for p in self.weight}
        self.elements = initial_elements(problem, init, dt, dev)
        self.incidences: dict[str, list[Incidence]] = defaultdict(list)
        for name in problem.spaces:
            for inc in problem.incidences(name):
                if inc.param in self.weight:
                    self.incidences[name].append(inc)
        self.static = _static_params(problem, self.weight)
        self.eps = torch.finfo(dt).eps
        self.static_terms: dict[Incidence, StatTerm] = {}
        #: static terms whose objective comes from float64 statistics (:meth:`_reduce_static`)
        self.exact: dict[Incidence, ExactStats] = {}
        with ctx.timer("stats"):
            for p, s in self.static.items():
                self._reduce_static(p, s)
        # what the rounding level of each parameter's objective is made of: B's squared
        # norm (weight included; no space changes it much) times the widths of the
        # products acting on the parameter, and its size
        self.state_sq: dict[str, float] = {}
        self.numel: dict[str, int] = {}
        for p in self.weight:
            pb = problem.params[p]
            width = sum(max(seg.size for seg in ab.segments) for ab in pb.axes) or 1
            self.state_sq[p] = state_rounding_sq(self.eps, width, self.weight[p], sqnorm(self.b0[p]))
            self.numel[p] = max(1, math.prod(pb.shape))
        self.cur: dict[str, torch.Tensor] = {}
        self.values: dict[str, Value] = {}
        if own_b:
            self._take_b(sd_b, init is not None)
        else:
            self.load(self.elements)

    def _reduce_static(self, p: str, s: str) -> None:
        """The statistics of a static parameter's terms, once. A dense action in a working
        precision coarser than float64 gets float64 statistics for its objective; a cheap
        action (a permutation) acts on the data instead, and so does a float64 one: there
        the statistics' cancellation (eps64 of ||a||^2) would exceed the float64 rounding
        of the distance itself."""
        exact = not solver_for(self.problem.spaces[s].group).cheap_apply and self.eps > torch.finfo(torch.float64).eps
        dt = self.ctx.dtype
        for inc in self._incs_of(p, s):
            a = segment(self.problem, self.a[p], inc, self.elements)
            b = segment(self.problem, self.b0[p], inc, self.elements)
            w = self.weight[p]
            if exact:
                orthogonal = self.problem.spaces[s].group.is_orthogonal(inc.factor.path) and inc.factor.variance != "abs"
                ex = self.exact[inc] = exact_stats(a, b, w, orthogonal)
                self.static_terms[inc] = StatTerm(
                    inc.factor.path, inc.factor.variance, ex.cross.to(dt), ex.gram.to(dt), ex.rows_sq.to(dt),
                    gram_a=functools.partial(_weighted_gram, a, w))
                continue
            self.static_terms[inc] = StatTerm(
                inc.factor.path, inc.factor.variance, w * (a @ b.mT),
                functools.partial(_weighted_gram, b, w), w * _row_norms_sq(a),
                gram_a=functools.partial(_weighted_gram, a, w))

    def _take_b(self, sd_b: Mapping[str, torch.Tensor], moved: bool) -> None:
        """B's tensors become the working copy (``moved``: transformed by the initial
        elements first); the caller's dict gives them up."""
        assert isinstance(sd_b, dict)
        with self.ctx.timer("apply"):
            for p in self.weight:
                if p in self.static:
                    # kept as it is until aligned(), which may then act on it in place:
                    # unless another of the caller's names holds its memory (a tie)
                    sd_b.pop(p, None)
                    ptr = self.b0[p].untyped_storage().data_ptr()
                    if not any(v.untyped_storage().data_ptr() == ptr for v in sd_b.values() if isinstance(v, torch.Tensor)):
                        self.owned_static.add(p)
                    continue
                x = self.b0.pop(p)
                sd_b.pop(p, None)
                self.cur[p] = transform(self.problem, p, x, self.elements) if moved else x
        self._objectives()

    # -- the provider protocol ---------------------------------------------------------------
    def active(self, space: str) -> bool:
        return bool(self.incidences[space])

    def pairs(self) -> dict[str, str]:
        return joint_pairs(self.problem, self.incidences)

    def objective(self) -> Mapping[str, Value]:
        return self.values

    def load(self, elements: Mapping[str, Element]) -> None:
        """Set every element, and B transformed by them."""
        if any(p not in self.b0 for p in self.weight):
            self._move_to(elements)
            return
        self.elements = dict(elements)
        self.cur.clear()
        with self.ctx.timer("apply"):
            for p in self.weight:
                if p not in self.static:
                    self.cur[p] = transform(self.problem, p, self.b0[p], self.elements)
        self._objectives()

    def _move_to(self, elements: Mapping[str, Element]) -> None:
        """Act on the working copy until it holds B transformed by ``elements`` (when B
        itself was not kept): each space's change, conjugated by the factors after it."""
        with self.ctx.timer("apply"):
            for s, target in elements.items():
                group = self.problem.spaces[s].group
                if same_element(target, self.elements[s]):
                    continue
                delta = group.compose(target, group.inverse(self.elements[s]))
                for p in dict.fromkeys(inc.param for inc in self.incidences[s]):
                    if p not in self.static:
                        self.cur[p] = transform(self.problem, p, self.cur[p], {s: delta}, self.elements, only=s)
                self.elements[s] = target
        self._objectives()

    def aligned(self) -> dict[str, torch.Tensor]:
        """B transformed by the current elements, one entry per tie representative."""
        out = dict(self.cur)
        with self.ctx.timer("apply"):
            for p in self.static:
                if p in self.owned_static:
                    # B's own copy (own_b): transformed in place, a slice at a time along an
                    # axis no element acts on, rather than beside a second copy (a 152k x
                    # 896 embedding set the peak of a 0.5B match)
                    out[p] = transform_in_place(self.problem, p, self.b0.pop(p), self.elements)
                    self.owned_static.discard(p)
                else:
                    out[p] = transform(self.problem, p, self.b0[p], self.elements)
        return {p: self.problem.params[p].stored(x) for p, x in out.items()}

    def evaluate(self, news: Mapping[str, Element]) -> Trial | None:
        """The objective with ``news`` taken, on B's parameters transformed by the change.
        Transformed tensors are kept for :meth:`commit` up to ``trial_bytes`` in all;
        beyond, each is measured and let go, and built again (the same operations, so the
        same values) should the change be taken: a residual rotation's trial is a second
        copy of almost every weight, which set the peak memory of a large model's match."""
        steps: list[tuple[str, Element, dict[str, Element]]] = []
        elems = dict(self.elements)
        for s, new in news.items():
            group = self.problem.spaces[s].group
            old = elems[s]
            if not same_element(new, old):
                # the next space's factors are conjugated by this one's new element
                steps.append((s, group.compose(new, group.inverse(old)), dict(elems)))
            elems[s] = new
        if not steps:
            return None
        params = list(dict.fromkeys(inc.param for s in news for inc in self.incidences[s]))
        trial: dict[str, torch.Tensor | None] = {}
        after: dict[str, Value] = {}
        kept = 0
        for p in params:
            if p in self.static:
                continue
            with self.ctx.timer("apply"):
                x = self._stepped(p, steps)
            if x is None:
                continue
            with self.ctx.timer("objective"):
                after[p] = self._value(p, elems, x)
            keep = kept + x.numel() * x.element_size() <= self.trial_bytes
            trial[p] = x if keep else None
            kept += x.numel() * x.element_size() if keep else 0
            del x
        with self.ctx.timer("objective"):
            after = {p: after[p] if p in after else self._value(p, elems, None if p in self.static else self.cur[p])
                     for p in params}
            before = tuple(self.values[p] for p in params)
        return Trial(before, tuple(after.values()), (trial, after, elems, steps))

    def _stepped(self, p: str, steps: list[tuple[str, Element, dict[str, Element]]]) -> torch.Tensor | None:
        """B's working parameter ``p`` with the changes ``steps`` applied (None: none acts on it)."""
        x = None
        for s, delta, at in steps:
            if any(inc.param == p for inc in self.incidences[s]):
                x = transform(self.problem, p, self.cur[p] if x is None else x, {s: delta}, at, only=s)
        return x

    def commit(self, trial: Trial) -> None:
        cur, after, elems, steps = trial.state
        for p, x in cur.items():
            if x is None:  # measured and let go: built again
                with self.ctx.timer("apply"):
                    x = self._stepped(p, steps)
                assert x is not None
            self.cur[p] = x
        self.values.update(after)
        self.elements = elems

    # -- data ----------------------------------------------------------------------------------
    def _incs_of(self, p: str, s: str) -> list[Incidence]:
        return [inc for inc in self.incidences[s] if inc.param == p]

    def _objectives(self) -> None:
        with self.ctx.timer("objective"):
            for p in self.weight:
                self.values[p] = self._value(p, self.elements)

    def _value(self, p: str, elements: Mapping[str, Element], cur: torch.Tensor | None = None) -> Value:
        """Parameter ``p``'s objective and its rounding level (``cur``: B's parameter as
        transformed by ``elements``, default the working copy's)."""
        v, err = self._objective(p, elements, cur)
        return Value(v, rounding_level(v, err, self.state_sq[p], self.numel[p]))

    def _objective(self, p: str, elements: Mapping[str, Element], cur: torch.Tensor | None = None) -> tuple[float, float]:
        """Parameter ``p``'s objective and the error of computing it."""
        if p in self.static:
            return self._static_objective(p, elements)
        x = self.cur[p] if cur is None else cur
        v = self.weight[p] * sqdist(self.a[p], x)
        return v, EVAL_ROUNDING * torch.finfo(x.dtype).eps * v

    def _static_objective(self, p: str, elements: Mapping[str, Element]) -> tuple[float, float]:
        s = self.static[p]
        incs = self._incs_of(p, s)
        if not all(inc in self.exact for inc in incs):
            # acting on the data costs about what the data does for a cheap action (a
            # head group's n x n matrix is block-permuted, with per-head inverses), and
            # in float64 only the distance itself is exact to the distance's precision
            x = transform(self.problem, p, self.b0[p], {s: elements[s]})
            v = self.weight[p] * sqdist(self.a[p], x)
            return v, EVAL_ROUNDING * torch.finfo(x.dtype).eps * v
        group = self.problem.spaces[s].group
        total = err = 0.0
        for inc in incs:
            t = self.static_terms[inc]
            f = group.matrix(elements[s], t.path, t.variance).to(torch.float64)  # type: ignore[arg-type]
            v, e = self.exact[inc].objective(f)
            total += v
            err += e
        # exact up to ``err``: a sum of squares below it is zero within its precision
        return max(total, 0.0), err

    # -- terms ---------------------------------------------------------------------------------
    def terms(self, space: str, partner: str | None = None, trusted: Set[str] | None = None) -> list[Term]:
        incs = incidence_roles(self.incidences, space, partner)
        unit = {space} if partner is None else {space, partner}
        if trusted is not None:
            # the terms no untrusted space moves; an all-zero one says nothing (an untrained
            # model's zero biases: alone, they left a GL head fit 0 / 0)
            keep = [x for x in incs if self.problem.params[x[0].param].spaces() - unit <= trusted
                    and bool(self.a[x[0].param].any())]
            incs = keep or incs
        entry = solver_for(self.problem.spaces[space].group)
        inv = {u: self.problem.spaces[u].group.inverse(self.elements[u]) for u in unit}
        merge = entry.variance_free and partner is None
        pieces: dict[tuple[Any, ...], list[Piece]] = defaultdict(list)
        static: dict[tuple[Any, ...], list[Term]] = defaultdict(list)
        undo: dict[tuple[Any, ...], Any] = {}
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
            a = segment(self.problem, self.a[inc.param], inc, self.elements)
            c = segment(self.problem, self.cur[inc.param], inc, self.elements)
            pieces[key].append(Piece(a, c, self.weight[inc.param]))
            if key not in undo:
                undo[key] = self._undo(inc, role, partner, inv)
        out: list[Term] = []
        for key in dict.fromkeys([*pieces, *static]):
            path, var, role, inner_var = key
            parts: list[Term] = list(static.get(key, []))
            if key in pieces:
                ps = pieces[key]
                wide = sum(p.a.shape[1] for p in ps) > ps[0].a.shape[0]
                parts.append(DataTerm(path, var, ps, undo[key], fold=wide and not entry.cheap_apply and role == "outer",
                                      role=role, inner_variance=inner_var))
            out.append(parts[0] if len(parts) == 1 else SumTerm(parts))
        return out

    def _undo(self, inc: Incidence, role: str, partner: str | None, inv: Mapping[str, Element]) -> Any:
        """What takes the current elements off a term's data: the space's (and, for a
        ``pair`` term, its partner's right after it)."""
        steps = [(self.problem.spaces[inc.factor.space].group, inv[inc.factor.space], inc.factor.path, inc.factor.variance)]
        if role == "pair":
            assert partner is not None
            nxt = inc.segment.factors[inc.position + 1]
            steps.append((self.problem.spaces[partner].group, inv[partner], nxt.path, nxt.variance))
        return functools.partial(_undo_chain, tuple(steps))
