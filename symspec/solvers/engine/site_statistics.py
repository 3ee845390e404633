"""Activation sites as statistics: a :class:`~.statistics.StatisticsProvider` that reads
each site's second moments directly, never a tensor per site.

The first design (:func:`~.activation_statistics.activation_terms`) factors every site's
moments into a pair of bound (features x rank) tensors and hands them to the weights'
provider. A site that needs no Gram (a permutation, an orthogonal map, a diagonal
scaling: most of a Transformer's) then holds two dense n x n tensors, one of them a
diagonal, and a site with two factors (``mlp[i] @ up[i]``) is multiplied out again
every round (an f x f x f product per site and round: 230 GFLOP at Qwen2-0.5B's 4864
units, three such sites per layer).

Here a site keeps, per block of its axis (a segment), what every solver reads:

- ``cross = E[a b^T]`` and, where a factor is not orthogonal, ``gram = E[b b^T]``;
  otherwise only its diagonal ``gdiag`` (all a monomial or orthogonal action reads);
- ``asq``: ``E[a_i^2]`` per feature.

A space's :class:`~.base.StatTerm` is the block with the factors acting after the space
undone on A's side (permutations only: then A's per-feature energies follow) and those
acting before it applied to B's side (on the statistics: ``C R^T``, ``R G R^T``). The
objective of a site is ``sum_blocks E||a||^2 - 2 <rho(g), C> + E||rho(g) b||^2`` from
the same statistics, in float64; its rounding level is the statistics' own precision
times the size of those three terms (they cancel).

:func:`site_statistics_supported` says whether every site of a problem can be
read this way (the factors acting after a space on a segment are permutations); the
activation methods fall back to the factored tensors where not.
:class:`CombinedStatistics` adds providers (the weights' terms and the sites' terms of
``weight+activation``).
"""

from __future__ import annotations

import math
from collections import OrderedDict, defaultdict
from collections.abc import Callable, Iterable, Mapping, Set
from typing import Any

import attrs
import torch

from ...groups import Element
from ...problem import Incidence, Problem, Segment, Site
from .activation_statistics import ActivationMoments, _diag_roots, _gram_roots, readable_sites
from .base import SolveContext, StatTerm, Term
from .spill import SPILL_MIN_BYTES, Spilled, SpillStore, held
from .statistics import StatisticsProvider, Trial, Value, same_element
from .weight_statistics import incidence_roles, initial_elements, joint_pairs

__all__ = ["CombinedStatistics", "SiteBlock", "SiteStatistics", "SiteStats", "merge_site_stats",
           "site_statistics_supported", "site_stats", "spill_blocks"]


@attrs.define
class SiteBlock:
    """One segment of a site: its statistics in the segment's (concatenated) order. The
    two square ones, ``cross`` and ``gram``, may be on disk (:class:`~.spill.Spilled`,
    :func:`spill_blocks`): read them with :func:`~.spill.held`."""

    segment: Segment
    cross: torch.Tensor | Spilled
    gram: torch.Tensor | Spilled | None
    gdiag: torch.Tensor
    asq: torch.Tensor

    def _all(self) -> list[Any]:
        return [self.cross, self.gdiag, self.asq, *([self.gram] if self.gram is not None else [])]

    @property
    def bytes(self) -> int:
        """Bytes held in memory."""
        return sum(t.numel() * t.element_size() for t in self._all() if isinstance(t, torch.Tensor))

    @property
    def disk_bytes(self) -> int:
        """Bytes on disk."""
        return sum(t.nbytes for t in self._all() if isinstance(t, Spilled))

    def scaled(self, s2: float, in_place: bool = False) -> SiteBlock:
        """Every statistic times ``s2`` (``in_place``: this block's tensors, returned; a
        spilled one is read back scaled, its file shared)."""
        def times(t: Any) -> Any:
            if t is None:
                return None
            if isinstance(t, Spilled):
                return t.scaled(s2)
            return t.mul_(s2) if in_place else t * s2

        out = SiteBlock(self.segment, times(self.cross), times(self.gram), times(self.gdiag), times(self.asq))
        if in_place:
            self.cross, self.gram = out.cross, out.gram
            return self
        return out


@attrs.define
class SiteStats:
    """A site's blocks (``names``: the sites whose statistics were added into these,
    :func:`merge_site_stats`)."""

    name: str
    blocks: list[SiteBlock]
    names: tuple[str, ...] = ()

    @property
    def bytes(self) -> int:
        return sum(b.bytes for b in self.blocks)

    @property
    def disk_bytes(self) -> int:
        return sum(b.disk_bytes for b in self.blocks)

    def energy(self) -> float:
        """``E||a||^2 + E||b||^2``."""
        return math.fsum(float(b.asq.double().sum()) + float(b.gdiag.double().sum()) for b in self.blocks)

    def structure(self) -> tuple[Any, ...]:
        return tuple((b.segment, b.gram is not None) for b in self.blocks)


def site_stats(problem: Problem, moments: ActivationMoments, *, normalize: str = "correlation",
               dtype: torch.dtype = torch.float32, release: bool = False,
               progress: Callable[[Any], None] | None = None) -> tuple[list[SiteStats], dict[str, list[float]]]:
    """Every site's moments as :class:`SiteStats` (means per token, in ``dtype``;
    standardised where ``normalize`` is ``correlation`` and every space of the site is a
    permutation group), for :class:`SiteStatistics`; and, per
    space, B's mean energy per feature of each of its sites (the ridge's scale).
    ``release``: each site's moments are dropped as soon as it is read."""
    out = []
    energy: dict[str, list[float]] = {}
    for name, site, m, corr in readable_sites(problem, moments, normalize, progress):
        blocks = []
        b_trace = 0.0
        for seg, (c, g, gd, asq) in zip(site.axis.segments, m.block_means(corr)):
            blocks.append(SiteBlock(seg, c.to(dtype), None if g is None else g.to(dtype), gd.to(dtype), asq.to(dtype)))
            b_trace += float(gd.sum())
            del c, g
        if release:
            del moments.moments[name], m
        out.append(SiteStats(name, blocks))
        for space in site.spaces():
            energy.setdefault(space, []).append(b_trace / max(site.size, 1))
    return out, energy


def merge_site_stats(stats: Iterable[SiteStats]) -> list[SiteStats]:
    """Sites whose blocks are acted on alike (the same segments, the same factors) added
    into one: their objectives are sums of the same linear functions of the statistics
    (a gated MLP's ``up`` output and ``down`` input, every residual read and write), so
    the sum is the objective of their sum. Keeps the first's name."""
    out: dict[tuple[Any, ...], SiteStats] = {}
    for s in stats:
        key = s.structure()
        have = out.get(key)
        if have is None:  # new blocks: the sums below never write into the caller's
            out[key] = SiteStats(s.name, [attrs.evolve(b) for b in s.blocks], s.names or (s.name,))
            continue
        for mine, theirs in zip(have.blocks, s.blocks):
            mine.cross = held(mine.cross) + held(theirs.cross)
            mine.gdiag = mine.gdiag + theirs.gdiag
            mine.asq = mine.asq + theirs.asq
            if mine.gram is not None and theirs.gram is not None:
                mine.gram = held(mine.gram) + held(theirs.gram)
        have.names = (*have.names, *(s.names or (s.name,)))
    return list(out.values())


def spill_blocks(stats: Iterable[SiteStats], store: SpillStore, min_bytes: int = SPILL_MIN_BYTES) -> int:
    """Every block's ``cross`` and ``gram`` of at least ``min_bytes`` written to ``store``
    (in place: the block then names its file); returns the bytes written."""
    written = 0
    for s in stats:
        for b in s.blocks:
            for field in ("cross", "gram"):
                t = getattr(b, field)
                if isinstance(t, torch.Tensor) and t.numel() * t.element_size() >= min_bytes:
                    setattr(b, field, store.put(t))
                    written += t.numel() * t.element_size()
    return written


def _is_permutation(problem: Problem, space: str) -> bool:
    si = problem.spaces.get(space)
    return si is not None and si.group.permutation_subgroup() == si.group


def site_statistics_supported(problem: Problem, sites: Iterable[Site]) -> bool:
    """Whether :class:`SiteStatistics` reads every site of ``sites``: every space is the
    problem's, and on each segment the factors acting after a space (``factors[:k]``)
    are permutations, whose inverse moves A's per-feature energies as it moves the
    features -- except the outer space of a joint pair, before its inner one (solved
    with it, nothing undone)."""
    sites = list(sites)
    if any(f.space not in problem.spaces for site in sites for seg in site.axis.segments for f in seg.factors):
        return False
    pairs = joint_pairs(problem, _site_incidences((site.name, site.axis.segments) for site in sites))
    for site in sites:
        for seg in site.axis.segments:
            f = seg.factors
            for pos in range(1, len(f)):
                if pos == 1 and pairs.get(f[0].space) == f[1].space:
                    continue
                if not all(_is_permutation(problem, x.space) for x in f[:pos]):
                    return False
    return True


def _site_incidences(sites: Iterable[tuple[str, Iterable[Segment]]]) -> dict[str, list[Incidence]]:
    """Space -> where it acts on the sites (name, segments): param ``site:NAME``, axis 0."""
    out: dict[str, list[Incidence]] = defaultdict(list)
    for name, segments in sites:
        for seg in segments:
            for pos, f in enumerate(seg.factors):
                out[f.space].append(Incidence(f"site:{name}", 0, seg, pos))
    return out


def _on_device(b: SiteBlock, device: torch.device) -> SiteBlock:
    """The block's tensors on ``device``; spilled ones stay on disk (read onto it when used)."""
    def move(t: Any) -> Any:
        return t.to(device) if isinstance(t, torch.Tensor) else t

    return SiteBlock(b.segment, move(b.cross), move(b.gram), b.gdiag.to(device), b.asq.to(device))


def _apply(problem: Problem, factors: Iterable[Any], x: torch.Tensor, elements: Mapping[str, Element],
           inverse: bool = False) -> torch.Tensor:
    """``x`` acted on (along its first axis) by ``factors``: the product, ``factors[-1]``
    first; with ``inverse``, its inverse (``factors[0]`` undone first)."""
    seq = list(factors) if inverse else list(reversed(list(factors)))
    for f in seq:
        g = problem.spaces[f.space].group
        e = g.inverse(elements[f.space]) if inverse else elements[f.space]
        x = g.apply(e, x, f.path, f.variance)  # type: ignore[arg-type]
    return x


#: bytes of spilled blocks held between a space's terms and the objective of its trial
HOT_BYTES = 1 << 28


def _cast(e: Element, dtype: torch.dtype) -> Element:
    return {k: v.to(dtype) if v.is_floating_point() else v for k, v in e.items()}


class SiteStatistics:
    """The objective ``sum_sites E||a - rho(g) b||^2`` from :class:`SiteStats` (see the
    module), at ``init`` (None or a space left out: the identity)."""

    def __init__(self, problem: Problem, sites: list[SiteStats], ctx: SolveContext,
                 init: Mapping[str, Element] | None = None) -> None:
        self.problem = problem
        self.ctx = ctx
        dev, dt = ctx.device, ctx.dtype
        sites = [SiteStats(s.name, [_on_device(b, dev) for b in s.blocks], s.names) for s in sites]
        self.sites = {s.name: s for s in sites}
        self.elements = initial_elements(problem, init, dt, dev)
        #: space -> its incidences (param: ``site:NAME``, axis 0, the block's segment)
        self.incidences = _site_incidences((s.name, [b.segment for b in s.blocks]) for s in sites)
        self._block = {(s.name, b.segment): b for s in sites for b in s.blocks}
        self.values: dict[str, Value] = {}
        #: the spilled blocks read back last (a space's terms, then its trial's objective
        #: over the same blocks), up to :data:`HOT_BYTES`, least recently read let go first
        self._hot: OrderedDict[tuple[str, float, str], torch.Tensor] = OrderedDict()
        self._objectives()

    def _held(self, x: torch.Tensor | Spilled, device: torch.device | str) -> torch.Tensor:
        """``x`` in memory on ``device``; a spilled block read back from :attr:`_hot` when there."""
        if not isinstance(x, Spilled):
            return x
        key = (x.file.path, x.scale, str(device))
        t = self._hot.get(key)
        if t is not None:
            self._hot.move_to_end(key)
            return t
        t = held(x, device)
        if t.nbytes <= HOT_BYTES:
            while self._hot and sum(v.nbytes for v in self._hot.values()) + t.nbytes > HOT_BYTES:
                self._hot.popitem(last=False)
            self._hot[key] = t
        return t

    # -- the provider protocol ---------------------------------------------------------------
    def active(self, space: str) -> bool:
        return bool(self.incidences[space])

    def pairs(self) -> dict[str, str]:
        return joint_pairs(self.problem, self.incidences)

    def objective(self) -> Mapping[str, Value]:
        return self.values

    def load(self, elements: Mapping[str, Element]) -> None:
        self.elements = dict(elements)
        self._objectives()

    def evaluate(self, news: Mapping[str, Element]) -> Trial | None:
        elems = dict(self.elements)
        changed = False
        for s, new in news.items():
            changed = changed or not same_element(new, elems[s])
            elems[s] = new
        if not changed:
            return None
        names = list(dict.fromkeys(inc.param[5:] for s in news for inc in self.incidences[s]))
        after = {n: self._value(self.sites[n], elems) for n in names}
        before = tuple(self.values[f"site:{n}"] for n in names)
        return Trial(before, tuple(after.values()), (after, elems))

    def commit(self, trial: Trial) -> None:
        after, elems = trial.state
        self.values.update({f"site:{n}": v for n, v in after.items()})
        self.elements = elems

    # -- terms ---------------------------------------------------------------------------------
    def terms(self, space: str, partner: str | None = None, trusted: Set[str] | None = None) -> list[Term]:
        out: list[Term] = []
        for inc, role, inner_var in incidence_roles(self.incidences, space, partner):
            b = self._block[(inc.param[5:], inc.segment)]
            f = inc.segment.factors
            left = f[: inc.position]
            right = f[inc.position + (2 if role == "pair" else 1):]
            out.append(self._term(b, left, right, inc, role, inner_var))
        return out

    def _term(self, b: SiteBlock, left: tuple[Any, ...], right: tuple[Any, ...], inc: Incidence, role: str,
              inner_var: str | None) -> Term:
        """The block as the space sees it: A with ``left`` undone (permutations: its
        per-feature energies move with it), B with ``right`` applied."""
        dt, dev = self.ctx.dtype, self.ctx.device
        el = self.elements
        cross, asq = self._held(b.cross, dev).to(dt), b.asq.to(dt)
        if left:
            cross = _apply(self.problem, left, cross, el, inverse=True)
            asq = _apply(self.problem, left, asq[:, None], el, inverse=True)[:, 0]
        if right:
            cross = _apply(self.problem, right, cross.mT, el).mT
        gram: torch.Tensor | Callable[[], torch.Tensor]
        if b.gram is not None:
            g = self._held(b.gram, dev).to(dt)
            if right:
                g = _apply(self.problem, right, _apply(self.problem, right, g, el).mT, el)
            gram, gdiag = g, g.diagonal()
        else:
            gd = b.gdiag.to(dt)
            if right:  # diag(R D R^T): the rows of R D^1/2, squared and summed
                gd = _apply(self.problem, right, torch.diag_embed(gd.clamp_min(0).sqrt()), el).square().sum(1)
            gdiag = gd
            gram = _lazy_diag(gd)
        c = cross
        term = StatTerm(inc.factor.path, inc.factor.variance, c, gram, asq, b_sq=gdiag.sum(), role=role,
                        inner_variance=inner_var, gram_a=_lazy_gram_a(c, gram, gdiag))
        term._cache["gram_diag"] = gdiag
        return term

    # -- the objective --------------------------------------------------------------------------
    def _objectives(self) -> None:
        with self.ctx.timer("objective"):
            for s in self.sites.values():
                self.values[f"site:{s.name}"] = self._value(s, self.elements)

    def _value(self, site: SiteStats, elements: Mapping[str, Element]) -> Value:
        """``sum_blocks E||a||^2 - 2 <rho, C> + E||rho b||^2`` in float64, and its level:
        the statistics' precision times the terms that cancel."""
        total = level = 0.0
        f64 = torch.float64
        el = {s: _cast(e, f64) for s, e in elements.items() if any(f.space == s for b in site.blocks for f in b.segment.factors)}
        for b in site.blocks:
            eps = torch.finfo(b.cross.dtype).eps
            factors = b.segment.factors
            a_sq = float(b.asq.to(f64).sum())
            dev = b.asq.device
            dot = float(_apply(self.problem, factors, self._held(b.cross, dev).to(f64).mT, el).diagonal().sum())
            if b.gram is not None:
                g = self._held(b.gram, dev).to(f64)
                b_sq = float(_apply(self.problem, factors, _apply(self.problem, factors, g, el).mT, el).diagonal().sum())
            elif all(self.problem.spaces[f.space].group.is_orthogonal(f.path) and f.variance != "abs" for f in factors):
                b_sq = float(b.gdiag.to(f64).sum())
            else:
                root = torch.diag_embed(b.gdiag.to(f64).clamp_min(0).sqrt())
                b_sq = float(_apply(self.problem, factors, root, el).square().sum())
            total += a_sq - 2 * dot + b_sq
            level += 4 * eps * (abs(a_sq) + 2 * abs(dot) + abs(b_sq))
        return Value(max(total, 0.0), level)


def _lazy_diag(gd: torch.Tensor) -> Callable[[], torch.Tensor]:
    return lambda: torch.diag_embed(gd)


def _lazy_gram_a(cross: torch.Tensor, gram: Any, gdiag: torch.Tensor) -> Callable[[], torch.Tensor]:
    """A's Gram as B's features explain it, ``C G^+ C^T`` (what the factored tensors'
    ``L_A L_A^T`` is): the equation-error start of a GL solve reads it."""

    def build() -> torch.Tensor:
        c = cross.double()
        if callable(gram):
            la, _ = _diag_roots(c, gdiag.double())
        else:
            la, _ = _gram_roots(c, gram.double())
        return (la @ la.mT).to(cross.dtype)

    return build


class CombinedStatistics:
    """Providers added: their terms for a space listed together, their objectives'
    parts side by side (named apart), one set of elements."""

    def __init__(self, problem: Problem, providers: list[StatisticsProvider]) -> None:
        self.problem = problem
        self.providers = providers

    @property
    def elements(self) -> dict[str, Element]:
        return self.providers[0].elements

    def active(self, space: str) -> bool:
        return any(p.active(space) for p in self.providers)

    def pairs(self) -> dict[str, str]:
        """Joint pairs over every provider's incidences (each provider says them:
        :class:`~.weight_statistics.WeightStatistics` and :class:`SiteStatistics` do)."""
        merged: dict[str, list[Incidence]] = defaultdict(list)
        for p in self.providers:
            for space, incs in p.incidences.items():  # type: ignore[attr-defined]
                merged[space].extend(incs)
        return joint_pairs(self.problem, merged)

    def terms(self, space: str, partner: str | None = None, trusted: Set[str] | None = None) -> list[Term]:
        return [t for p in self.providers if p.active(space) or (partner is not None and p.active(partner))
                for t in p.terms(space, partner, trusted)]

    def objective(self) -> Mapping[str, Value]:
        out: dict[str, Value] = {}
        for i, p in enumerate(self.providers):
            out.update({f"{i}:{k}": v for k, v in p.objective().items()})
        return out

    def evaluate(self, news: Mapping[str, Element]) -> Trial | None:
        trials = [p.evaluate(news) for p in self.providers]
        if all(t is None for t in trials):
            return None
        before = tuple(v for t in trials if t is not None for v in t.before)
        after = tuple(v for t in trials if t is not None for v in t.after)
        return Trial(before, after, trials)

    def commit(self, trial: Trial) -> None:
        for p, t in zip(self.providers, trial.state):
            if t is not None:
                p.commit(t)

    def load(self, elements: Mapping[str, Element]) -> None:
        for p in self.providers:
            p.load(elements)
