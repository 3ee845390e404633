"""What an alignment method is: the protocol every method implements, and what it is given.

A method aligns B to A on a bound problem. It is given the two endpoints in canonical form
(their weights and, for the methods that run data through them, their modules), the
evaluation data when the method needs some, and the options common to all methods; it
returns one element per space of the problem it was given, with its objective history and
timings. Everything around it (binding, canonicalisation, restricting the searched groups,
embedding the elements back in the spec's groups, transforming B, the record, the dtype
of the outputs) is done once for every method by :func:`symspec.align`.

>>> from symspec.alignment import Alignment
>>> Alignment(elements={}, history=[1.0]).converged
True
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import attrs

if TYPE_CHECKING:  # this module stays importable without torch: the CLI lists methods cheaply
    import torch

    from ..groups import Element
    from ..problem import Problem


@attrs.frozen
class Endpoint:
    """One model as a method sees it.

    ``state``: its canonical state dict (in the working dtype). ``module``: the model in
    canonical form (a module of the model's class holding ``state``), given to the methods
    that declare ``needs_module``; None otherwise or for state-dict inputs."""

    state: Mapping[str, torch.Tensor]
    module: torch.nn.Module | None = None


@attrs.frozen
class AlignOptions:
    """Options every method understands.

    ``rounds``/``tol``: at most ``rounds`` rounds of the method's iteration, fewer once a
    round gains less than ``tol`` (relative). ``device``/``dtype``: where the dense work
    runs and in which precision (None: the weights'). ``init``: a starting element per
    space (universe matching warm-starts from the previous round). ``data``: evaluation
    data (:class:`symspec.data.EvalData`, its train split) for the methods that need it;
    ``validation``: held-out data (the val split) for the methods that select a step
    (learned matching), None to let them hold out part of ``data``.
    ``progress``: called with :class:`~symspec.solvers.MatchEvent` values. ``timer``: a
    :class:`~symspec.solvers.Timer` the method adds its phases to. ``tuning``: the
    method's own knobs (an options object it documents, e.g.
    :class:`~symspec.solvers.WeightOptions`); None for its defaults. ``consume_b``: the
    method may take B's tensors out of ``b.state`` (a dict it then owns) and return them
    transformed in :attr:`Alignment.aligned`, saving a copy of B on large models."""

    rounds: int = 10
    tol: float = 1e-6
    device: str | torch.device = "cpu"
    dtype: torch.dtype | None = None
    init: Mapping[str, Element] | None = None
    data: Any = None
    validation: Any = None
    progress: Callable[[Any], None] | None = None
    timer: Any = None
    tuning: Any = None
    consume_b: bool = False


@attrs.define
class Alignment:
    """What a method returns: ``elements``, one per space it searched (in the groups of the
    problem it was given; a space left out is the identity); ``history``: its objective
    before the first round and after each (a single value for one-shot methods);
    ``timings``: seconds per phase; ``aligned``: B's bound tensors already transformed by
    ``elements`` when the method built them (one entry per tie representative), else None;
    ``info``: anything else worth reporting (JSON-able)."""

    elements: dict[str, Element]
    history: list[float]
    timings: dict[str, float] = attrs.field(factory=dict)
    converged: bool = True
    aligned: dict[str, torch.Tensor] | None = None
    info: dict[str, Any] = attrs.field(factory=dict)


@runtime_checkable
class Method(Protocol):
    """An alignment method, registered under ``name`` (:func:`symspec.alignment.register_method`).

    ``label``: how reports and plots name it. ``canonical``: whether it works on canonical
    forms (False only for vanilla averaging, which interpolates the weights as they are).
    ``needs_data``: it reads ``options.data``. ``needs_module``: its endpoints must carry
    their modules. ``groups``: the searched groups when the user gives none (``"perm"``
    for the permutation-only ablation; None: the spec's full groups). Optional:
    ``validates`` (True for a method that picks its result on ``options.validation``;
    callers then give it a split other than the one they evaluate on);
    ``objective_is_distance`` (True when ``history[0]`` is the squared weight distance of
    canonical A and B, as for weight matching: :func:`symspec.align` then need not
    measure it); ``candidate`` (True for a closed-form method that ``auto`` tries, with
    its default options: :mod:`symspec.alignment.auto`)."""

    name: str
    label: str
    canonical: bool
    needs_data: bool
    needs_module: bool
    groups: str | None

    def align(self, problem: Problem, a: Endpoint, b: Endpoint, options: AlignOptions) -> Alignment:
        """Find the element of every space of ``problem`` that brings ``b`` closest to ``a``."""
        ...
