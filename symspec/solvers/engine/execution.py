"""How the solves of one schedule class are run: threads, the background batched solve,
overlap on few cores.

The descent (:mod:`.descent`) hands an execution strategy one class of spaces at a time,
with the primitives of the work (:class:`ClassWork`: a space's terms, a solve, taking a
solution). Spaces of a class share no parameter, so a strategy may interleave their
statistics and solves as it likes, as long as it takes the solutions of each group of
spaces in order and runs every torch operation at a thread count that does not depend on
timing: the result is then the same, bit for bit, whatever the strategy (tested).

:func:`symspec.process.torch_threads` is the one helper that sets torch's thread count.
"""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Protocol

import attrs
import torch

from ...groups import Element, Group
from ...process import torch_threads
from .base import SolveContext, Term, solver_for


def solver_threads(device: torch.device, threads: int) -> contextlib.AbstractContextManager[None]:
    """Run the solvers' small dense linear algebra (batched inverses, SVDs of n x n
    statistics) with few CPU threads: on a loaded machine, OpenMP-parallel LAPACK over
    small matrices is up to 10x slower than one thread (measured on these CPUs). Only
    ever lowers the count, and only on the CPU."""
    lower = device.type == "cpu" and 0 < threads < torch.get_num_threads()
    return torch_threads(threads if lower else 0)


class ClassWork(Protocol):
    """What the descent gives a strategy for one schedule class."""

    ctx: SolveContext

    def terms(self, space: str) -> list[Term]:
        """The space's terms (a joint pair's, for its outer space), statistics not yet computed."""
        ...

    def current(self, space: str) -> Element: ...

    def solve(self, group: Group, terms: list[Term], current: Element) -> Element:
        """One space's new element (its kind's solver); safe to run in a worker thread."""
        ...

    def solve_many(self, group: Group, problems: list[tuple[list[Term], Element]]) -> list[Element]:
        """Several spaces of one group at once; safe to run in a worker thread."""
        ...

    def solve_pair(self, space: str, terms: list[Term]) -> dict[str, Element]:
        """A joint pair's new elements (inner space first)."""
        ...

    def accept(self, news: dict[str, Element]) -> bool:
        """Take the new elements if they lower the objective; whether they were taken."""
        ...

    def done(self, space: str) -> None:
        """Report a space solved (progress)."""
        ...


#: (group, spaces of the class in it)
Batch = tuple[Group, list[str]]


class Execution(Protocol):
    """An execution strategy: runs one schedule class and returns the spaces whose
    element changed. ``pairs``: (outer, inner) spaces solved jointly; ``batched``: groups
    whose spaces are solved in one call (:meth:`ClassWork.solve_many`); ``piped``: groups
    whose spaces are solved one at a time."""

    def run_class(self, work: ClassWork, pairs: Sequence[tuple[str, str]], batched: Sequence[Batch],
                  piped: Sequence[Batch]) -> list[str]: ...


#: batched solves running in the background: (spaces, their future solutions)
Background = list[tuple[list[str], Future[list[Element]]]]


def _statistics(ctx: SolveContext, terms: list[Term]) -> None:
    with ctx.timer("stats"):
        for t in terms:
            t.cross()


@attrs.frozen
class ThreadedExecution:
    """The default strategy. Statistics are computed on the calling thread (large
    products, threaded by torch); assignments run in a pool, ``lap_workers`` at a time
    (scipy's release the GIL), while the next space's statistics are computed. With
    ``overlap``, on a machine with few cores (:meth:`overlaps`) a batched solve (the
    within-head maps of all layers) runs in a worker too, beside the assignment
    pipeline, instead of after it with a core idle; torch's threads drop to
    ``threads`` meanwhile. ``threads``: CPU threads for the solvers' own small linear
    algebra (see :func:`solver_threads`)."""

    #: linear assignments of one class solved at once; more than 1 gained nothing on 2
    #: cores and costs memory (docs/matching.md)
    lap_workers: int = 1
    overlap: bool = True
    threads: int = 1

    def overlaps(self, device: torch.device) -> bool:
        """Whether batched solves run beside the assignment pipeline: on the CPU, when
        torch's threads are at most the solvers' own plus one (2 cores: the statistics'
        products and the within-head solves each get one). With more cores the products
        keep them all and the solves run after, as small threaded LAPACK calls beside
        busy threads are many times slower (see :func:`solver_threads`)."""
        return self.overlap and device.type == "cpu" and self.threads > 0 and torch.get_num_threads() <= self.threads + 1

    def run_class(self, work: ClassWork, pairs: Sequence[tuple[str, str]], batched: Sequence[Batch],
                  piped: Sequence[Batch]) -> list[str]:
        changed: list[str] = []
        for s, t in pairs:
            changed += self._pair(work, s, t)
        background = bool(piped) and self.overlaps(work.ctx.device)
        workers = max(1, self.lap_workers) + (len(batched) if background else 0)
        full = torch.get_num_threads()
        later: Background = []
        with ThreadPoolExecutor(max_workers=workers) as pool, contextlib.ExitStack() as low:
            for group, names in batched:
                problems = [(work.terms(s), work.current(s)) for s in names]
                with self._step_threads(later, full):
                    self._prepare_batch(work, group, problems, evict=background)
                if background:
                    if not later:
                        # from here until every background solve is done, torch runs with
                        # the solvers' own threads except for steps taken once they are
                        # (_step_threads): their small ops always see one thread count,
                        # so the result does not depend on timing
                        low.enter_context(torch_threads(self.threads))
                    later.append((names, pool.submit(work.solve_many, group, problems)))
                else:
                    with solver_threads(work.ctx.device, self.threads):
                        news = work.solve_many(group, problems)
                    changed += _accept_each(work, names, news)
                del problems
            for group, names in piped:
                changed += self._pipeline(work, group, names, pool, later, full)
            for names, fut in later:
                news = fut.result()
                with self._step_threads(later, full):
                    changed += _accept_each(work, names, news)
        return changed

    def _pair(self, work: ClassWork, s: str, t: str) -> list[str]:
        terms = work.terms(s)
        changed: list[str] = []
        if terms:
            _statistics(work.ctx, terms)
            with solver_threads(work.ctx.device, self.threads):
                news = work.solve_pair(s, terms)
            del terms
            if work.accept(news):
                changed = [s, t]
        work.done(s)
        work.done(t)
        return changed

    @staticmethod
    def _prepare_batch(work: ClassWork, group: Group, problems: list[tuple[list[Term], Element]], evict: bool) -> None:
        """Every statistic of a batched solve; with ``evict`` (it runs while the pipeline's
        statistics take memory), only those it reads are kept, not the transformed data
        behind them (the solver registers what it reads)."""
        entry = solver_for(group)
        with work.ctx.timer("stats"):
            for ts, _ in problems:
                for t in ts:
                    t.cross()
            if evict and entry.prefetch is not None:
                for ts, _ in problems:
                    entry.prefetch(group, ts)
                    for t in ts:
                        t.evict()

    @staticmethod
    def _step_threads(background: Background, full: int) -> contextlib.AbstractContextManager[None]:
        """Torch threads for a step on this thread: all of them (``full``) once nothing
        runs in the background any more, else the count set for the background section."""
        return torch_threads(full) if all(f.done() for _, f in background) else contextlib.nullcontext()

    def _pipeline(self, work: ClassWork, group: Group, names: list[str], pool: ThreadPoolExecutor,
                  background: Background, full: int) -> list[str]:
        """Spaces of one class and group, one at a time: statistics on this thread, solves
        in ``pool``, so the next space's statistics are computed while up to
        ``lap_workers`` solves run. Solutions are taken here, in order, and at most
        ``lap_workers`` spaces' statistics wait at once (memory stays bounded). While a
        batched solve runs in ``background``, the products leave it its core; once it is
        done they get all ``full`` threads again."""
        workers = max(1, self.lap_workers)
        changed: list[str] = []
        pending: deque[tuple[str, Future[Element] | None]] = deque()

        def settle(limit: int) -> None:
            while len(pending) > limit:
                s, fut = pending.popleft()
                if fut is not None and work.accept({s: fut.result()}):
                    changed.append(s)
                work.done(s)

        for s in names:
            with self._step_threads(background, full):
                terms = work.terms(s)
                _statistics(work.ctx, terms)
                pending.append((s, pool.submit(work.solve, group, terms, work.current(s)) if terms else None))
                del terms
                settle(workers)
        with self._step_threads(background, full):
            settle(0)
        return changed


def _accept_each(work: ClassWork, names: list[str], news: list[Element]) -> list[str]:
    changed = []
    for s, new in zip(names, news):
        if work.accept({s: new}):
            changed.append(s)
        work.done(s)
    return changed
