"""What every per-space solver sees: terms, their statistics, and the solver registry.

Weight matching minimises ``sum_P ||A_P - g.B_P||_F^2`` over the elements of every space.
With all spaces but one fixed, each place where that space acts (a parameter, an axis, a
segment) becomes a *term*: the segment moved to the front and flattened, ``a`` from
model A and ``b`` from model B with every other space applied. The space's solver then
minimises ``sum_terms w ||a - F(g) b||^2`` where ``F(g)`` is the action of the term's
representation and variance (``co``: rho(g), ``contra``: rho(g)^-T, ``abs``: |rho(g)|).

Solvers only read the statistics of a term: ``cross = sum w a b^T``, ``gram = sum w b b^T``
and ``a_sq = sum w ||a||^2``, each ``[*batch, n, n]`` (or ``[*batch]``). A term can hold
the data (computed lazily, summed over parameters) or precomputed statistics, so that
parameters no other space touches are reduced once, and a large residual term is
reduced in the cheaper order.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import attrs
import torch

from ...errors import SymspecInputError
from ...groups import Element, Group, Path, kind_entry


class SolverError(SymspecInputError):
    """A matching problem the solvers cannot handle (an unsupported group or variance)."""


#: a transform acting along the first non-batch dimension: F(g)^-1 of the current element
Undo = Callable[[torch.Tensor], torch.Tensor]


class Term:
    """Statistics of one (path, variance) class of a space's incidences.

    Subclasses compute them their own way; every value is cached. For a pair of spaces
    solved jointly (a permutation and the diagonal scaling that acts right after it,
    ``mlp[i] @ scale[i]``), ``role`` says whether the term is acted on by the outer space
    alone (``"outer"``, the default), by both (``"pair"``: ``b`` has both undone and the
    inner space acts with ``inner_variance``), or by the inner one alone (``"inner"``).
    """

    path: Path
    variance: str

    def __init__(self, path: Path, variance: str, role: str = "outer", inner_variance: str | None = None) -> None:
        self.path = tuple(path)
        self.variance = variance
        self.role = role
        self.inner_variance = inner_variance
        self._cache: dict[Any, torch.Tensor] = {}

    @property
    def key(self) -> tuple[Any, ...]:
        return (self.path, self.variance, self.role, self.inner_variance)

    def _cached(self, key: Any, fn: Callable[[], torch.Tensor]) -> torch.Tensor:
        if key not in self._cache:
            self._cache[key] = fn()
        return self._cache[key]

    def cross(self) -> torch.Tensor:
        """sum w a b^T, [*batch, n, n]."""
        return self._cached("cross", self._cross)

    def gram(self) -> torch.Tensor:
        """sum w b b^T, [*batch, n, n]."""
        return self._cached("gram", self._gram)

    def gram_blocks(self, size: int) -> torch.Tensor:
        """The diagonal blocks of ``gram``, [*batch, n / size, size, size]."""
        return self._cached(("gram_blocks", size), lambda: self._gram_blocks(size))

    def gram_diag(self) -> torch.Tensor:
        """The diagonal of ``gram``: sum w ||b_i||^2 per row i, [*batch, n]."""
        return self._cached("gram_diag", self._gram_diag)

    def cross_diag(self) -> torch.Tensor:
        """The diagonal of ``cross``, [*batch, n] (all a diagonal group's solver reads)."""
        return self._cached("cross_diag", self._cross_diag)

    def a_sq(self) -> torch.Tensor:
        """sum w ||a||^2, [*batch]."""
        return self._cached("a_sq", lambda: self.rows_sq().sum(-1))

    def gram_a(self) -> torch.Tensor:
        """sum w a a^T, [*batch, n, n] (model A's side; for the equation-error start of GL)."""
        return self._cached("gram_a", self._gram_a)

    def gram_a_blocks(self, size: int) -> torch.Tensor:
        """The diagonal blocks of ``gram_a``, [*batch, n / size, size, size]."""
        return self._cached(("gram_a_blocks", size), lambda: _diag_blocks(self.gram_a(), size))

    def rows_sq(self) -> torch.Tensor:
        """sum w ||a_i||^2 per row i, [*batch, n]."""
        return self._cached("rows_sq", self._rows_sq)

    def _cross(self) -> torch.Tensor:
        raise NotImplementedError

    def _gram(self) -> torch.Tensor:
        raise NotImplementedError

    def _rows_sq(self) -> torch.Tensor:
        raise NotImplementedError

    def _gram_diag(self) -> torch.Tensor:
        return torch.diagonal(self.gram(), dim1=-2, dim2=-1)

    def _cross_diag(self) -> torch.Tensor:
        return torch.diagonal(self.cross(), dim1=-2, dim2=-1)

    def _gram_a(self) -> torch.Tensor:
        raise SolverError("this term does not carry A's Gram matrix")

    def _gram_blocks(self, size: int) -> torch.Tensor:
        return _diag_blocks(self.gram(), size)

    def evict(self) -> None:
        """Let go of data kept only to compute statistics not asked for yet (they are
        recomputed if asked for later); terms that keep none have nothing to do."""


def _diag_blocks(g: torch.Tensor, size: int) -> torch.Tensor:
    n = g.shape[-1]
    blocks = g.reshape(*g.shape[:-2], n // size, size, n // size, size)
    return torch.diagonal(blocks, dim1=-4, dim2=-2).movedim(-1, -3)


class StatTerm(Term):
    """A term given by its statistics (``gram`` may be a callable, computed on demand)."""

    def __init__(self, path: Path, variance: str, cross: torch.Tensor,
                 gram: torch.Tensor | Callable[[], torch.Tensor], rows_sq: torch.Tensor,
                 b_sq: torch.Tensor | None = None, role: str = "outer", inner_variance: str | None = None,
                 gram_a: torch.Tensor | Callable[[], torch.Tensor] | None = None) -> None:
        super().__init__(path, variance, role, inner_variance)
        #: sum w ||b||^2 when known (what ||F(g) b||^2 is for orthogonal F)
        self.b_sq = b_sq
        self._ga = gram_a
        self._c = cross
        self._g = gram
        self._r = rows_sq

    def _cross(self) -> torch.Tensor:
        return self._c

    def _gram(self) -> torch.Tensor:
        return self._g() if callable(self._g) else self._g

    def _rows_sq(self) -> torch.Tensor:
        return self._r

    def _gram_a(self) -> torch.Tensor:
        if self._ga is None:
            return super()._gram_a()
        return self._ga() if callable(self._ga) else self._ga


class DiagStatTerm(Term):
    """A term whose cross and Gram matrices are diagonal, given by their diagonals (a
    diagonal group's problem once a permutation is fixed): the n x n matrices are built
    only if asked for."""

    def __init__(self, path: Path, variance: str, cross_diag: torch.Tensor, gram_diag: torch.Tensor,
                 rows_sq: torch.Tensor) -> None:
        super().__init__(path, variance)
        self._cd, self._gd, self._r = cross_diag, gram_diag, rows_sq

    def _cross_diag(self) -> torch.Tensor:
        return self._cd

    def _gram_diag(self) -> torch.Tensor:
        return self._gd

    def _cross(self) -> torch.Tensor:
        return torch.diag_embed(self._cd)

    def _gram(self) -> torch.Tensor:
        return torch.diag_embed(self._gd)

    def _rows_sq(self) -> torch.Tensor:
        return self._r


class SumTerm(Term):
    """Terms of one (path, variance), added up."""

    def __init__(self, terms: list[Term]) -> None:
        super().__init__(terms[0].path, terms[0].variance, terms[0].role, terms[0].inner_variance)
        self.terms = terms

    def _cross(self) -> torch.Tensor:
        return _sum(t.cross() for t in self.terms)

    def _gram_diag(self) -> torch.Tensor:
        return _sum(t.gram_diag() for t in self.terms)

    def _cross_diag(self) -> torch.Tensor:
        return _sum(t.cross_diag() for t in self.terms)

    def _gram(self) -> torch.Tensor:
        return _sum(t.gram() for t in self.terms)

    def _gram_blocks(self, size: int) -> torch.Tensor:
        return _sum(t.gram_blocks(size) for t in self.terms)

    def _rows_sq(self) -> torch.Tensor:
        return _sum(t.rows_sq() for t in self.terms)

    def _gram_a(self) -> torch.Tensor:
        return _sum(t.gram_a() for t in self.terms)

    def gram_a_blocks(self, size: int) -> torch.Tensor:
        return self._cached(("gram_a_blocks", size), lambda: _sum(t.gram_a_blocks(size) for t in self.terms))

    def evict(self) -> None:
        for t in self.terms:
            t.evict()


@attrs.frozen
class Piece:
    """One incidence's data: ``a`` [n, m] from A, ``c`` [n, m] from the current B (every
    space applied, including the one being solved), and its weight."""

    a: torch.Tensor
    c: torch.Tensor
    weight: float = 1.0


class DataTerm(Term):
    """A term computed from data: pieces sharing one (path, variance), summed.

    ``b = undo(c)`` removes the current element of the space being solved. When the
    pieces are wide (m > n) and ``undo`` is a dense map, the statistics are reduced
    first and undone on the n x n result (``fold=True``): cross = undo(C_c^T)^T.
    """

    def __init__(self, path: Path, variance: str, pieces: list[Piece], undo: Undo, fold: bool,
                 role: str = "outer", inner_variance: str | None = None) -> None:
        super().__init__(path, variance, role, inner_variance)
        self.pieces = pieces
        self.undo = undo
        self.fold = fold
        self._b: dict[int, torch.Tensor] = {}

    def b(self, k: int) -> torch.Tensor:
        if k not in self._b:
            self._b[k] = self.undo(self.pieces[k].c)
        return self._b[k]

    def evict(self) -> None:
        """Let go of the transformed data kept for the statistics (a copy of B's
        segments); a statistic not yet computed recomputes it."""
        self._b.clear()

    def _cross(self) -> torch.Tensor:
        if self.fold:
            cc = _sum(_weighted(p.weight, p.a @ p.c.mT) for p in self.pieces)
            return self.undo(cc.mT).mT
        if len(self.pieces) > 1 and all(p.a.ndim == 2 for p in self.pieces):
            return _sum(self._fused_cross(group) for group in _fuse_groups(self.pieces))
        return _sum(_weighted(p.weight, p.a @ self.b(k).mT) for k, p in enumerate(self.pieces))

    def _fused_cross(self, pieces: list[Piece]) -> torch.Tensor:
        """sum w a b^T over pieces as one product of their side-by-side concatenations:
        ``undo`` acts on rows, so it is applied once to the concatenated current data (an
        FF space's two weights: one [f, 2d] x [2d, f] product, 1.5x the speed of two
        [f, d] x [d, f] ones on 2 cores)."""
        if len(pieces) == 1:
            p = pieces[0]
            return _weighted(p.weight, p.a @ self.undo(p.c).mT)
        a = torch.cat([p.a for p in pieces], -1)
        col = 0
        for p in pieces:
            if p.weight != 1.0:
                a[:, col : col + p.a.shape[-1]] *= p.weight
            col += p.a.shape[-1]
        b = self.undo(torch.cat([p.c for p in pieces], -1))
        return a @ b.mT

    def _gram(self) -> torch.Tensor:
        if self.fold:
            gc = _sum(_weighted(p.weight, p.c @ p.c.mT) for p in self.pieces)
            return self.undo(self.undo(gc).mT).mT
        return _sum(_weighted(p.weight, self.b(k) @ self.b(k).mT) for k, p in enumerate(self.pieces))

    def _gram_diag(self) -> torch.Tensor:
        if self.fold:
            return super()._gram_diag()
        return _sum(p.weight * torch.linalg.vector_norm(self.b(k), dim=-1).square() for k, p in enumerate(self.pieces))

    def _gram_blocks(self, size: int) -> torch.Tensor:
        if self.fold:
            return super()._gram_blocks(size)
        out = []
        for k, p in enumerate(self.pieces):
            b = self.b(k)
            bb = b.reshape(*b.shape[:-2], b.shape[-2] // size, size, b.shape[-1])
            out.append(_weighted(p.weight, bb @ bb.mT))
        return _sum(out)

    def _rows_sq(self) -> torch.Tensor:
        return _sum(p.weight * torch.linalg.vector_norm(p.a, dim=-1).square() for p in self.pieces)

    def _gram_a(self) -> torch.Tensor:
        return _sum(_weighted(p.weight, p.a @ p.a.mT) for p in self.pieces)

    def gram_a_blocks(self, size: int) -> torch.Tensor:
        def blocks() -> torch.Tensor:
            out = []
            for p in self.pieces:
                aa = p.a.reshape(*p.a.shape[:-2], p.a.shape[-2] // size, size, p.a.shape[-1])
                out.append(_weighted(p.weight, aa @ aa.mT))
            return _sum(out)

        return self._cached(("gram_a_blocks", size), blocks)


#: pieces are concatenated for one product up to this many columns in all (bounded
#: temporaries: two [n, FUSE_COLUMNS] copies at most)
FUSE_COLUMNS = 4096


def _fuse_groups(pieces: list[Piece]) -> list[list[Piece]]:
    """Consecutive runs of pieces whose concatenation stays within ``FUSE_COLUMNS``."""
    groups: list[list[Piece]] = []
    width = 0
    for p in pieces:
        m = p.a.shape[-1]
        if groups and width + m <= FUSE_COLUMNS and p.a.dtype == groups[-1][0].a.dtype:
            groups[-1].append(p)
            width += m
        else:
            groups.append([p])
            width = m
    return groups


def _weighted(w: float, x: torch.Tensor) -> torch.Tensor:
    """``w x``, without a pass over (and a fresh copy of) an n x n product when w is 1."""
    return x if w == 1.0 else w * x


def _sum(xs: Any) -> torch.Tensor:
    it = iter(xs)
    total = next(it)
    for x in it:
        total = total + x
    return total


# ---------------------------------------------------------------------------------------
# timing


class Timer:
    """Wall-clock seconds per phase, accumulated (``with timer("assign"): ...``). Phases
    that run in several threads at once (assignments beside the next space's statistics)
    add up their own seconds, so the phases can sum to more than the wall time."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self._lock = threading.Lock()

    @contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            with self._lock:
                self.seconds[phase] += time.perf_counter() - t0
                self.calls[phase] += 1

    def as_dict(self) -> dict[str, float]:
        return dict(self.seconds)


@attrs.define
class SolveContext:
    """Per-run settings and instruments handed to every solver."""

    device: torch.device = attrs.field(factory=lambda: torch.device("cpu"))
    dtype: torch.dtype = torch.float64
    timer: Timer = attrs.field(factory=Timer)
    #: Gauss-Newton iterations per solve of a GL map (the iteration resumes next round),
    #: stopping early once a step gains less than ``rtol`` (relative)
    max_iter: int = 5
    rtol: float = 1e-6


# ---------------------------------------------------------------------------------------
# the registry

SolverFn = Callable[[Group, list[Term], Element, SolveContext], Element]
#: solve several spaces of one group at once: [(terms, current)] -> [element]
ManyFn = Callable[[Group, list[tuple[list[Term], Element]], SolveContext], list[Element]]


@attrs.frozen
class SolverEntry:
    """How to solve one group kind.

    ``cheap_apply``: the action costs O(size of the data) (permutations, diagonal,
    block-local maps), so undoing it on data beats reducing first. ``batched``: the solver
    vectorises over leading batch dimensions, so independent spaces of one group are
    stacked and solved in one call. ``solve_many``: a kind-specific way to solve several
    spaces at once (head groups batch their within-head problems across layers).
    ``variance_free``: every variance acts alike (a permutation is its own inverse
    transpose and its own absolute value), so the engine merges a space's terms of all
    variances into one ``co`` term, whose statistics come from fewer, larger products.
    """

    solve: SolverFn
    cheap_apply: bool
    batched: bool = False
    solve_many: ManyFn | None = None
    variance_free: bool = False
    #: compute, on the calling thread, every statistic the solver will read from a
    #: space's terms, so their cached transformed data can be let go before the solve
    #: runs elsewhere (:meth:`DataTerm.evict`)
    prefetch: Callable[[Group, list[Term]], None] | None = None


SOLVERS: dict[str, SolverEntry] = {}


def solver(*kinds: str, cheap_apply: bool, batched: bool = False,
           variance_free: bool = False) -> Callable[[SolverFn], SolverFn]:
    """Register a solver for group kinds: ``fn(group, terms, current, ctx) -> element``."""

    def deco(fn: SolverFn) -> SolverFn:
        for k in kinds:
            SOLVERS[k] = SolverEntry(fn, cheap_apply, batched, variance_free=variance_free)
        return fn

    return deco


def solver_many(*kinds: str) -> Callable[[ManyFn], ManyFn]:
    """Register a many-spaces solver for kinds that already have a solver."""

    def deco(fn: ManyFn) -> ManyFn:
        for k in kinds:
            SOLVERS[k] = attrs.evolve(SOLVERS[k], solve_many=fn)
        return fn

    return deco


def prefetcher(*kinds: str) -> Callable[[Callable[[Group, list[Term]], None]], Callable[[Group, list[Term]], None]]:
    """Register the statistics a kind's solver reads (see ``SolverEntry.prefetch``)."""

    def deco(fn: Callable[[Group, list[Term]], None]) -> Callable[[Group, list[Term]], None]:
        for k in kinds:
            SOLVERS[k] = attrs.evolve(SOLVERS[k], prefetch=fn)
        return fn

    return deco


class StackTerm(Term):
    """Terms of several independent problems stacked along a new leading batch dimension."""

    def __init__(self, terms: list[Term]) -> None:
        super().__init__(terms[0].path, terms[0].variance, terms[0].role, terms[0].inner_variance)
        self.terms = terms

    def _cross(self) -> torch.Tensor:
        return torch.stack([t.cross() for t in self.terms])

    def _gram_diag(self) -> torch.Tensor:
        return torch.stack([t.gram_diag() for t in self.terms])

    def _gram(self) -> torch.Tensor:
        return torch.stack([t.gram() for t in self.terms])

    def _gram_blocks(self, size: int) -> torch.Tensor:
        return torch.stack([t.gram_blocks(size) for t in self.terms])

    def _rows_sq(self) -> torch.Tensor:
        return torch.stack([t.rows_sq() for t in self.terms])

    def _gram_a(self) -> torch.Tensor:
        return torch.stack([t.gram_a() for t in self.terms])

    def evict(self) -> None:
        for t in self.terms:
            t.evict()


def stack_elements(elements: list[Element]) -> Element:
    return {k: torch.stack([e[k] for e in elements]) for k in elements[0]}


def unstack_element(e: Element, count: int) -> list[Element]:
    return [{k: v[i] for k, v in e.items()} for i in range(count)]


def solve_stacked(group: Group, problems: list[tuple[list[Term], Element]], ctx: SolveContext) -> list[Element]:
    """Solve independent problems of one group in one call (same term layout required)."""
    entry = solver_for(group)
    terms: list[Term] = [StackTerm([ts[i] for ts, _ in problems]) for i in range(len(problems[0][0]))]
    current = stack_elements([e for _, e in problems])
    return unstack_element(entry.solve(group, terms, current, ctx), len(problems))


#: a pair solved jointly: (outer, inner, terms, (outer element, inner element), ctx) -> both
JointFn = Callable[[Group, Group, list[Term], tuple[Element, Element], SolveContext], tuple[Element, Element]]

#: (outer kind, inner kind) -> joint solver, for spaces that act back to back on one axis
#: (``mlp[i] @ scale[i]``), where coordinate descent between the two gets stuck
JOINT: dict[tuple[str, str], JointFn] = {}


def joint_solver(*pairs: tuple[str, str]) -> Callable[[JointFn], JointFn]:
    def deco(fn: JointFn) -> JointFn:
        for pair in pairs:
            JOINT[pair] = fn
        return fn

    return deco


def solver_for(group: Group) -> SolverEntry:
    """The kind's entry in :data:`SOLVERS`; a kind without one (or with a NoEntry) is a
    :class:`SolverError` naming the kind."""
    return kind_entry(SOLVERS, group, "weight-matching solver", error=SolverError)


def objective(group: Group, terms: list[Term], element: Element) -> torch.Tensor:
    """sum_terms w ||a - F(g) b||^2 from the statistics, per batch entry [*batch], in
    float64: its three terms cancel, and in float32 they would leave float32 noise of
    their size (a negative objective). The statistics are as exact as their own dtype."""
    total: torch.Tensor | None = None
    f64 = torch.float64
    for t in terms:
        f = group.matrix(element, t.path, t.variance).to(f64)  # type: ignore[arg-type]
        val = t.a_sq().to(f64) - 2 * (f * t.cross().to(f64)).sum((-1, -2)) + ((f @ t.gram().to(f64)) * f).sum((-1, -2))
        total = val if total is None else total + val
    assert total is not None
    return total


def variances(terms: list[Term]) -> set[str]:
    return {t.variance for t in terms}


def require_variances(group: Group, terms: list[Term], allowed: set[str]) -> None:
    bad = variances(terms) - allowed
    if bad:
        raise SolverError(f"weight matching for {group} does not support {', '.join(sorted(bad))} terms")


@solver("Id", cheap_apply=True)
def solve_trivial(group: Group, terms: list[Term], current: Element, ctx: SolveContext) -> Element:
    """The trivial group has one element."""
    return current
