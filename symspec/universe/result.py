"""What a universe run found: :class:`UniverseResult` (models given as files, modules or
state dicts, under a spec) and :class:`StateUniverse` (canonical state dicts under a
problem, :func:`~symspec.universe.state_universe`).

Every model gets one element ``g_i`` into the universe, so any two models are aligned
to each other through it: ``g_{i->j} = g_j^-1 g_i``, cycle-consistent by construction
(``g_{j->k} g_{i->j} = g_{i->k}``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import torch

from ..groups import Element, Group
from ..record import TransformRecord
from .errors import UniverseError
from .workdir import load_tensors, round_dir


@attrs.frozen
class ModelEntry:
    """One input model: ``name`` as given (a path, or ``model{i}``), ``key`` a unique
    file-safe name (``03-seed3``), ``format`` of its source (see symspec.loading) and
    ``dtype``, the one dtype its weights are stored in (None: mixed), which its outputs
    are written in."""

    index: int
    name: str
    key: str
    path: str | None
    format: str
    dtype: str | None = None


def method_history(rounds: Sequence[Mapping[str, Any]]) -> list[float]:
    """The rounds' own objective of their method (``method_objective``): before the
    first round, then after each; empty where a round did not record it."""
    if not rounds or any("method_objective" not in r for r in rounds):
        return []
    return [rounds[0]["method_objective_start"], *(r["method_objective"] for r in rounds)]


@attrs.define
class UniverseResult:
    """What :func:`universe_match` found.

    ``merged``: the universe after the last round (canonical form; loads into
    ``canonical_model``). ``aligned``: each model aligned into it (None unless
    ``load_aligned``; else read them with :meth:`aligned_state` while the work folder
    lives). ``records``: each model's transform into the universe. ``history``: the
    objective ``sum_i ||U - g_i·θ_i||^2`` before the first round and after each.
    ``rounds``: per round, each model's distance to the round's target before and after
    its alignment, and seconds. ``timings``: seconds per phase. ``method``: the alignment
    method of every round.
    """

    bound: Any
    models: list[ModelEntry]
    start: int
    merged: dict[str, torch.Tensor]
    records: list[TransformRecord]
    history: list[float]
    rounds: list[dict[str, Any]]
    converged: bool
    timings: dict[str, float]
    executor: str
    jobs: int
    dtype: str
    groups: str
    aligned: list[dict[str, torch.Tensor]] | None = None
    canonical_model: torch.nn.Module | None = None
    reference: Any = None  # the reference's LoadedModel when it came from a file
    workdir: Path | None = None
    resumed: int = 0
    max_in_flight: int = 0
    #: the registered alignment method that aligned every model in each round (for
    #: ``learned``: the method whose refinement followed weight matching's rounds)
    method: str = "weight"
    #: the learned refinement's account (:mod:`symspec.universe.learned`), or None
    refinement: dict[str, Any] | None = None
    #: what the rounds stopped on: ``weights`` (F) or ``method`` (the method's own
    #: objective, per round ``method_objective``: a data-driven method's)
    converged_on: str = "weights"

    @property
    def spec(self) -> Any:
        """The spec the models were matched under."""
        return self.bound.spec

    @property
    def names(self) -> list[str]:
        """The models' names, as given."""
        return [m.name for m in self.models]

    def index(self, model: int | str) -> int:
        """A model's index, from its index, its name as given or its key."""
        if isinstance(model, int):
            if not 0 <= model < len(self.models):
                raise UniverseError(f"no model {model}: there are {len(self.models)}")
            return model
        for m in self.models:
            if model in (m.name, m.key):
                return m.index
        raise UniverseError(f"no model named {model!r}; models: {', '.join(self.names)}")

    def aligned_state(self, model: int | str) -> dict[str, torch.Tensor]:
        """Model ``model`` aligned into the universe (canonical form)."""
        i = self.index(model)
        if self.aligned is not None:
            return self.aligned[i]
        path = self.aligned_path(i)
        if path is None or not path.exists():
            raise UniverseError("the aligned models were not kept: pass load_aligned=True or a workdir")
        return load_tensors(path)

    def aligned_path(self, model: int | str) -> Path | None:
        """Where the kept work folder holds model ``model`` aligned (None without one)."""
        if self.workdir is None:
            return None
        i = self.index(model)
        return round_dir(self.workdir, len(self.rounds)) / f"{self.models[i].key}.aligned.safetensors"

    def transform(self, source: int | str, target: int | str) -> TransformRecord:
        """The transform aligning model ``source`` to model ``target`` through the
        universe: ``g_target^-1 g_source``, acting on ``source``'s canonical form."""
        i, j = self.index(source), self.index(target)
        return transform_between(self.records, i, j, {"method": "universe", "from": self.models[i].name,
                                                      "to": self.models[j].name})

    def summary(self) -> dict[str, Any]:
        """A JSON-able account of the run (the ``universe`` part of the report)."""
        h0 = self.history[0] if self.history else 0.0
        return {
            "spec": self.spec.name,
            "groups": self.groups,
            "method": self.method,
            "start": self.models[self.start].name,
            "models": [{"index": m.index, "name": m.name, "key": m.key, "format": m.format,
                        "distance_before": self.rounds[0]["models"][m.index]["before"] if self.rounds else None,
                        "distance_after": self.rounds[-1]["models"][m.index]["after"] if self.rounds else None}
                       for m in self.models],
            "rounds": len(self.rounds),
            "converged": self.converged,
            "objective": list(self.history),
            "relative_objective": [h / h0 if h0 else 0.0 for h in self.history],
            "converged_on": self.converged_on,
            "method_objective": method_history(self.rounds),
            "per_round": self.rounds,
            "executor": self.executor,
            "jobs": self.jobs,
            "dtype": self.dtype,
            "resumed_tasks": self.resumed,
            "timings": dict(self.timings),
            **({"refinement": self.refinement} if self.refinement is not None else {}),
        }


@attrs.define
class StateUniverse:
    """What :func:`~symspec.universe.state_universe` found for canonical state dicts:
    ``merged`` (the universe), ``elements[i]`` (model i's element into it, one per space
    of the problem, in its groups), ``history`` (the objective before the first round and
    after each), ``rounds`` (their account) and ``converged``."""

    problem: Any  # symspec.problem.Problem
    merged: dict[str, torch.Tensor]
    elements: list[dict[str, Element]]
    history: list[float]
    rounds: list[dict[str, Any]]
    converged: bool

    def between(self, source: int, target: int) -> dict[str, Element]:
        """``g_target^-1 g_source``: model ``source`` aligned to model ``target``."""
        groups = {s: si.group for s, si in self.problem.spaces.items()}
        return relative_elements(groups, self.elements[source], self.elements[target])


def relative_elements(groups: Mapping[str, Group], g_source: Mapping[str, Element],
                      g_target: Mapping[str, Element]) -> dict[str, Element]:
    """``g_target^-1 g_source`` per space: a model's element into the universe seen from
    another model's frame (cycle-consistent by construction)."""
    return {s: groups[s].compose(groups[s].inverse(g_target[s]), g) for s, g in g_source.items()}


def transform_between(records: Sequence[TransformRecord], source: int, target: int,
                      meta: Mapping[str, Any] | None = None) -> TransformRecord:
    """``g_target^-1 g_source`` from universe records (see :meth:`UniverseResult.transform`)."""
    ri, rj = records[source], records[target]
    elements = relative_elements({s: ri.group(s) for s in ri.elements}, ri.elements, rj.elements)
    return attrs.evolve(ri, elements=elements, inverted=False,
                        meta=dict(meta) if meta is not None else {"method": "universe", "from": source, "to": target})


__all__ = ["ModelEntry", "StateUniverse", "UniverseResult", "relative_elements", "transform_between"]
