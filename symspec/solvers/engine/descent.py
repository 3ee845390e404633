"""Coordinate descent over the spaces of a problem, on a statistics provider.

A round solves every searched space once, with all others fixed, by the solver its
group kind registers (:data:`symspec.solvers.engine.base.SOLVERS`); rounds repeat until the
objective stops improving. The descent reads only the provider's terms and objective
(:mod:`.statistics`) and knows no architecture:

- spaces that share no parameter do not interact; they form one colour class of the
  schedule, and the class order puts the most connected spaces first (the residual
  stream before the heads and units that hang off it);
- two spaces acting back to back whose kinds register a joint solver (a permutation and
  the scaling right before it) are solved as one, where the provider gives their terms;
- the first round starts greedily (each space from the data whose other spaces are
  already solved), and is redone plainly should it end above the start;
- a new element is kept only if the objective over what it acts on goes down by more
  than its rounding level, so the reported objective is monotone by construction and no
  decision rests on rounding noise;
- how the solves of a class are run (threads, overlap) is an execution strategy
  (:mod:`.execution`), injected.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Mapping
from typing import Any

import attrs
import torch

from ...groups import Element, Group
from ...problem import Problem
from .base import JOINT, SolveContext, Term, solve_stacked, solver_for
from .execution import Batch, Execution
from .statistics import StatisticsProvider, total, total_level


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


@attrs.frozen
class DescentResult:
    """``history``: the objective before the first round, then after each; ``changed``:
    the spaces whose element changed in the last round."""

    history: list[float]
    changed: list[str]
    converged: bool


class Descent:
    """Coordinate descent on ``provider`` (whose elements it changes), solving with
    ``ctx`` and running each schedule class with ``execution``. Spaces whose group is
    trivial, or that have no term, are not searched. Fails early for a searched kind
    without a solver."""

    def __init__(self, problem: Problem, provider: StatisticsProvider, ctx: SolveContext, execution: Execution) -> None:
        self.problem = problem
        self.provider = provider
        self.ctx = ctx
        self.execution = execution
        self.searched = [s for s, si in problem.spaces.items() if not si.group.is_trivial() and provider.active(s)]
        self.pairs = {s: t for s, t in provider.pairs().items() if s in self.searched and t in self.searched}
        for s in self.searched:
            solver_for(problem.spaces[s].group)
        inner = set(self.pairs.values())
        units = [s for s in self.searched if s not in inner]
        self.classes = schedule(problem, units, {s: {s, t} for s, t in self.pairs.items()})
        self.moves = _Moves(problem, {s: {s, t} for s, t in self.pairs.items()})

    def total(self) -> float:
        return total(self.provider.objective().values())

    def run(self, rounds: int, tol: float, greedy_start: bool = True, progress: Progress | None = None) -> DescentResult:
        """At most ``rounds`` rounds; stop earlier once a round changes no element, or
        gains less than ``tol`` (relative) or no more than the rounding level of the two
        values. ``greedy_start``: start the first round greedily."""
        say = progress or (lambda e: None)
        history = [self.total()]
        levels = [total_level(self.provider.objective().values())]
        say(MatchEvent("start", 0, rounds, total=len(self.searched), objective=history[0]))
        changed: list[str] = []
        start = dict(self.provider.elements)
        self.moves.reset()
        for r in range(1, rounds + 1):
            changed, done = self._round(r, rounds, r == 1 and greedy_start, history[0], start, say)
            history.append(self.total())
            levels.append(total_level(self.provider.objective().values()))
            say(MatchEvent("round", r, rounds, done=done, total=len(self.searched), objective=history[-1]))
            prev, now = history[-2], history[-1]
            # a gain within the rounding level of the two values is no gain, whatever ``tol``
            if not changed or prev - now <= max(tol * abs(prev), levels[-2] + levels[-1], 1e-300):
                return DescentResult(history, changed, True)
        return DescentResult(history, changed, False)

    def _round(self, r: int, rounds: int, greedy_first: bool, start_value: float, start: Mapping[str, Element],
               say: Progress) -> tuple[list[str], int]:
        """One round: (spaces changed, spaces solved). Greedy first: each space is solved
        from the data whose other spaces it already has (an embedding before any layer
        has been aligned); should that end above ``start_value``, the round is redone
        the plain way from ``start``."""
        changed: list[str] = []
        done = 0
        for greedy in ((True, False) if greedy_first else (False,)):
            changed = []
            done = 0

            def on_done(s: str) -> None:
                nonlocal done
                done += 1
                say(MatchEvent("space", r, rounds, s, done, len(self.searched), self.total()))

            trusted: set[str] | None = set() if greedy else None
            for cls in self.classes:
                changed += self.solve_class(cls, on_done, trusted)
                if trusted is not None:
                    trusted |= set(cls)
            if not greedy or self.total() <= start_value:
                break
            self.provider.load(start)
            self.moves.reset()
        return changed, done

    def solve_class(self, spaces: list[str], on_done: Callable[[str], None], trusted: set[str] | None = None) -> list[str]:
        """Solve spaces that share no parameter; returns those whose element changed.
        ``trusted`` (the first round's greedy start): use only the data whose other
        spaces are already solved, and keep every solution (the caller checks the round).
        A group's spaces are solved in one call where its solver batches them (the head
        groups of all layers), else one at a time."""
        if trusted is None:
            # a space whose last plain solve changed nothing, with nothing it reads moved
            # since, would get the same terms and the same answer: it is not solved again
            settled = [s for s in spaces if self.moves.settled(s)]
            for s in settled:
                for t in (s, self.pairs[s]) if s in self.pairs else (s,):
                    on_done(t)
            spaces = [s for s in spaces if s not in settled]
        by_group: dict[Group, list[str]] = defaultdict(list)
        for s in spaces:
            if s not in self.pairs:
                by_group[self.problem.spaces[s].group].append(s)
        batched: list[Batch] = []
        piped: list[Batch] = []
        for group, names in by_group.items():
            entry = solver_for(group)
            many = entry.solve_many is not None or (entry.batched and len(names) > 1)
            (batched if many else piped).append((group, names))
        pairs = [(s, self.pairs[s]) for s in spaces if s in self.pairs]
        return self.execution.run_class(_ClassWork(self, on_done, trusted), pairs, batched, piped)

    def accept(self, news: Mapping[str, Element], force: bool = False) -> bool:
        """Keep the new elements (a space, or a joint pair: inner space first) if they
        lower the objective over what they act on by more than its rounding level (or
        ``force``): a change within rounding noise is not taken, so it neither moves the
        weights nor counts as progress. Non-finite elements are never taken."""
        if not all(bool(torch.isfinite(v).all()) for e in news.values() for v in e.values() if v.is_floating_point()):
            return False  # a solver that broke down (a NaN matrix) is never taken, forced or not
        trial = self.provider.evaluate(news)
        if trial is None:
            return False
        if not force and not trial.gain() > trial.noise():
            return False
        self.provider.commit(trial)
        return True


class _ClassWork:
    """The primitives of one class's work (:class:`.execution.ClassWork`)."""

    def __init__(self, descent: Descent, on_done: Callable[[str], None], trusted: set[str] | None) -> None:
        self.descent = descent
        self.ctx = descent.ctx
        self.on_done = on_done
        self.trusted = trusted

    def terms(self, space: str) -> list[Term]:
        return self.descent.provider.terms(space, self.descent.pairs.get(space), self.trusted)

    def current(self, space: str) -> Element:
        return self.descent.provider.elements[space]

    def solve(self, group: Group, terms: list[Term], current: Element) -> Element:
        with self.ctx.timer(f"solve:{group.kind}"):
            return solver_for(group).solve(group, terms, current, self.ctx)

    def solve_many(self, group: Group, problems: list[tuple[list[Term], Element]]) -> list[Element]:
        entry = solver_for(group)
        with self.ctx.timer(f"solve:{group.kind}"):
            if entry.solve_many is not None:
                return entry.solve_many(group, problems, self.ctx)
            return _solve_stacked(group, problems, self.ctx)

    def solve_pair(self, space: str, terms: list[Term]) -> dict[str, Element]:
        partner = self.descent.pairs[space]
        spaces, elements = self.descent.problem.spaces, self.descent.provider.elements
        gs, gt = spaces[space].group, spaces[partner].group
        with self.ctx.timer(f"solve:{gs.kind}+{gt.kind}"):
            new_s, new_t = JOINT[(gs.kind, gt.kind)](gs, gt, terms, (elements[space], elements[partner]), self.ctx)
        return {partner: new_t, space: new_s}

    def accept(self, news: dict[str, Element]) -> bool:
        taken = self.descent.accept(news, force=self.trusted is not None)
        self.descent.moves.note(news, taken, plain=self.trusted is None)
        return taken

    def done(self, space: str) -> None:
        self.on_done(space)


class _Moves:
    """Which spaces moved since which solve: a space whose last plain solve (every term, no
    greedy start) took no new element is settled until a space acting on one of its
    parameters moves. Its terms are then what they were, so a solver (deterministic, from
    the terms and the current element) would give the element back again: the descent
    skips it. ``covers``: a joint pair's outer space -> both its spaces."""

    def __init__(self, problem: Problem, covers: Mapping[str, set[str]]) -> None:
        self.version = 0
        self.moved: dict[str, int] = {}
        self.quiet: dict[str, int] = {}
        self.reads: dict[str, set[str]] = {}
        for s in problem.spaces:
            cover = set(covers.get(s, {s}))
            self.reads[s] = cover | {t for p in problem.params.values() if cover & (ps := p.spaces()) for t in ps}

    def reset(self) -> None:
        """Forget every settled space (the elements were set from outside)."""
        self.quiet.clear()
        self.version += 1
        self.moved = dict.fromkeys(self.moved, self.version)

    def note(self, news: Mapping[str, Element], taken: bool, plain: bool) -> None:
        """A solve of the spaces ``news`` ended: ``taken`` or not, from every term (``plain``)."""
        if taken:
            self.version += 1
            for s in news:
                self.moved[s] = self.version
                self.quiet.pop(s, None)
        elif plain:
            for s in news:
                self.quiet[s] = self.version

    def settled(self, space: str) -> bool:
        since = self.quiet.get(space)
        return since is not None and all(self.moved.get(t, -1) <= since for t in self.reads[space])


def _solve_stacked(group: Group, problems: list[tuple[list[Term], Element]], ctx: SolveContext) -> list[Element]:
    """Independent problems of one group, stacked where their terms have one layout."""
    by_sig: dict[Any, list[int]] = defaultdict(list)
    for i, (ts, _) in enumerate(problems):
        by_sig[tuple((t.path, t.variance) for t in ts)].append(i)
    out: list[Element | None] = [None] * len(problems)
    for idx in by_sig.values():
        for i, e in zip(idx, solve_stacked(group, [problems[i] for i in idx], ctx)):
            out[i] = e
    return out  # type: ignore[return-value]
