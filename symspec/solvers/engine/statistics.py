"""Where the statistics come from: the seam between matching and its data.

Coordinate descent (:mod:`.descent`) and the per-kind solvers never read weights or
activations: a solver reads a space's :class:`~symspec.solvers.engine.base.Term` statistics
(``C = sum w a b^T``, ``G = sum w b b^T``, ``||a||^2``), and the descent compares values
of the objective. A *statistics provider* supplies both, for the current element of
every space:

- :meth:`StatisticsProvider.terms`: a space's terms (a :class:`~.base.DataTerm` computed
  from data, a :class:`~.base.StatTerm` given by precomputed statistics, or their
  :class:`~.base.SumTerm`), every other space's element applied;
- the objective, split into *parts* (a bound parameter, an activation site, ...), each
  with its rounding level (:class:`Value`): :meth:`~StatisticsProvider.objective` now,
  :meth:`~StatisticsProvider.evaluate` with new elements (a :class:`Trial`), which
  :meth:`~StatisticsProvider.commit` takes.

The weights' provider is :class:`~.weight_statistics.WeightStatistics`. Another one (an
activation provider: per space, cross-covariance and Gram statistics of A's and B's
activations at its sites, as StatTerms, and the objective per site from them with
:func:`~.base.objective`) plugs into the same descent and solvers through
``match_weights(..., provider=factory)``, where ``factory(problem, ctx, init)`` builds it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Set
from typing import Any, Protocol

import attrs
import torch

from ...groups import Element
from ...problem import Problem
from .base import SolveContext, Term


@attrs.frozen
class Value:
    """One part of the objective and its rounding level: two values closer than their
    levels together are not told apart (a change within them is rounding noise)."""

    value: float
    level: float


@attrs.frozen
class Trial:
    """New elements, evaluated and not yet taken: the parts they change, their values
    before and after (in the same order), and what the provider keeps to take them
    (``state``: transformed data, the new elements)."""

    before: tuple[Value, ...]
    after: tuple[Value, ...]
    state: Any = None

    def gain(self) -> float:
        """How much the objective goes down."""
        return math.fsum(v.value for v in self.before) - math.fsum(v.value for v in self.after)

    def noise(self) -> float:
        """The rounding level of :meth:`gain`."""
        return math.fsum(b.level + a.level for b, a in zip(self.before, self.after))


class StatisticsProvider(Protocol):
    """The statistics of a matching problem at the current elements (see the module).

    ``elements``: the current element of every space of the problem (the provider's
    state: the descent reads it, and changes it only through :meth:`commit` and
    :meth:`load`).
    """

    elements: dict[str, Element]

    def active(self, space: str) -> bool:
        """Whether ``space`` has any term (a space without one is not searched)."""
        ...

    def pairs(self) -> Mapping[str, str]:
        """outer -> inner: pairs of spaces the provider can give joint terms for (roles
        ``outer``/``pair``/``inner``, see :class:`~.base.Term`), where their kinds have a
        joint solver (:data:`~.base.JOINT`); empty if none."""
        ...

    def terms(self, space: str, partner: str | None = None, trusted: Set[str] | None = None) -> list[Term]:
        """The terms of ``space`` (with ``partner``, the inner space of one of
        :meth:`pairs`: the pair's terms), every other space's current element applied.
        ``trusted`` (the first round's greedy start): prefer the data that no untrusted
        space acts on; a provider whose terms do not depend on other spaces ignores it."""
        ...

    def objective(self) -> Mapping[str, Value]:
        """The objective now, per part."""
        ...

    def evaluate(self, news: Mapping[str, Element]) -> Trial | None:
        """The parts that the spaces of ``news`` act on, before and with the new elements
        (applied in order: a joint pair's inner space first); None when no element
        changes. Nothing changes until :meth:`commit`."""
        ...

    def commit(self, trial: Trial) -> None:
        """Take the elements of ``trial``, which :meth:`evaluate` made from the current
        state."""
        ...

    def load(self, elements: Mapping[str, Element]) -> None:
        """Set every element (the descent goes back to its start with this)."""
        ...


#: builds a provider for one run: (problem, ctx, init) -> a provider at ``init`` (a
#: starting element per space; None or a space left out: the identity), whose tensors
#: live on ``ctx.device`` in ``ctx.dtype``
ProviderFactory = Callable[[Problem, SolveContext, Mapping[str, Element] | None], StatisticsProvider]


def total(values: Iterable[Value]) -> float:
    """The objective: its parts summed (exactly rounded)."""
    return math.fsum(v.value for v in values)


def total_level(values: Iterable[Value]) -> float:
    """The rounding level of :func:`total`."""
    return math.fsum(v.level for v in values)


def same_element(new: Element, old: Element) -> bool:
    """The same fields, bit for bit (not :meth:`~symspec.groups.Group.equal`, which builds
    every action matrix)."""
    return all(torch.equal(new[k], old[k].to(new[k].device)) for k in old)
