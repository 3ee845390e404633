"""Working copies, canonicalised and transformed in place.

check() keeps one float64 copy of the model (plus a float32 one when float32 is checked)
and moves its weights in place: each row applies sampled elements parameter by
parameter, runs the model and undoes them (the inverse elements, applied in the reverse
order of every factor chain; parameters bound with |rho| are restored from a copy, since
|rho(g)|^-1 is |rho(g^-1)| only for monomial groups). Nothing holds a second full copy of
the weights: a float64 check of a float32 model needs twice the model's size (more when
the spec unties a tied head) plus about one parameter's worth of transient memory; the
float32 mirror adds the model's size once more.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ..binding import BoundSpec
from ..groups import Element
from ..precision import KeepFloat64
from ..problem import ParamBinding, Problem
from ..transforms import inverse_elements, transform_tensor
from ..transforms.apply import reversed_binding
from ..transforms.canonicalize import canonicalize_structure
from .canonical import canonicalize_inplace
from .forward import copy_as, forward_outputs, live_tensors


class InPlace:
    """Applies group elements to a module's weights in place, and undoes them (LIFO)."""

    def __init__(self, problem: Problem, tensors: Mapping[str, torch.Tensor]) -> None:
        self.problem = problem
        self.tensors = tensors
        self._reversed: dict[str, ParamBinding] = {}

    def _targets(self, spaces: set[str]) -> list[tuple[str, ParamBinding]]:
        return [(n, b) for n, b in self.problem.params.items() if n in self.tensors and b.spaces() & spaces]

    @staticmethod
    def has_abs(binding: ParamBinding, spaces: set[str]) -> bool:
        return any(f.variance == "abs" and f.space in spaces for a in binding.axes for s in a.segments for f in s.factors)

    def apply(self, elements: Mapping[str, Element]) -> tuple[list[str], dict[str, torch.Tensor]]:
        """Act with ``elements``; returns the changed names and what undo() needs."""
        spaces = set(elements)
        changed: list[str] = []
        saved: dict[str, torch.Tensor] = {}
        seen: set[int] = set()
        with torch.no_grad():
            for name, binding in self._targets(spaces):
                t = self.tensors[name]
                changed.append(name)
                if id(t) in seen:  # a tied twin: one tensor, transformed once
                    continue
                seen.add(id(t))
                if self.has_abs(binding, spaces):
                    saved[name] = t.detach().clone()
                t.copy_(transform_tensor(self.problem, binding, t.detach(), elements))
        return changed, saved

    def undo(self, elements: Mapping[str, Element], token: tuple[list[str], dict[str, torch.Tensor]]) -> list[str]:
        changed, saved = token
        spaces = set(elements)
        inverse = inverse_elements(self.problem, elements)
        seen: set[int] = set()
        with torch.no_grad():
            for name, binding in self._targets(spaces):
                t = self.tensors[name]
                if id(t) in seen:
                    continue
                seen.add(id(t))
                if name in saved:
                    t.copy_(saved[name])
                    continue
                rev = self._reversed.get(name)
                if rev is None:
                    rev = self._reversed[name] = reversed_binding(binding)
                t.copy_(transform_tensor(self.problem, rev, t.detach(), inverse))
        return changed


class Models:
    """The float64 working copy and, when float32 is checked, a float32 mirror of it."""

    def __init__(self, model: torch.nn.Module, inputs: Any, dtypes: Sequence[str], exact64: bool,
                 outputs: Sequence[str] = ()) -> None:
        self.inputs = inputs
        self.outputs = tuple(outputs)  # the spec's outputs: those compared (all where empty)
        self.work = copy_as(model, torch.float64)
        self.m32 = copy_as(model, torch.float32) if "float32" in dtypes else None
        self.keep = KeepFloat64(rewrite=exact64)
        self.dirty: set[str] = set()
        self.refresh()

    def refresh(self) -> None:
        self.t64 = live_tensors(self.work)
        self.t32 = live_tensors(self.m32) if self.m32 is not None else {}
        self.dirty = set(self.t32)

    def run(self, dt: str) -> list[torch.Tensor]:
        if dt == "float64":
            return forward_outputs(self.work, self.inputs, torch.float64, self.keep, self.outputs)
        assert self.m32 is not None
        if self.dirty:
            with torch.no_grad():
                for name in self.dirty:
                    self.t32[name].copy_(self.t64[name])
            self.dirty.clear()
        return forward_outputs(self.m32, self.inputs, torch.float32, keys=self.outputs)

    def canonicalize(self, bound: BoundSpec) -> None:
        canonicalize_inplace(bound, self.work)
        if self.m32 is not None:  # its values come from the float64 copy
            canonicalize_structure(bound, self.m32)
        self.refresh()


class Walk:
    """One space's elements, sample after sample, in place: g_1, then g_2 g_1^-1, ...

    Each step is a single action instead of an undo and an apply; spaces bound with
    |rho| anywhere are walked by undo and apply, since |rho| is not a representation.
    """

    def __init__(self, problem: Problem, mover: InPlace, models: Models, names: Sequence[str]) -> None:
        self.problem = problem
        self.mover = mover
        self.models = models
        self.direct = not any(mover.has_abs(problem.params[p], set(names)) for i in names for p in problem.params_of(i))
        self.current: dict[str, Element] = {}
        self.token: Any = None

    def to(self, target: dict[str, Element]) -> None:
        if self.current and self.direct:
            g = self.problem.spaces
            step = {i: g[i].group.compose(target[i], g[i].group.inverse(self.current[i])) for i in target}
            self.models.dirty.update(self.mover.apply(step)[0])
        else:
            self.home()
            self.token = self.mover.apply(target)
            self.models.dirty.update(self.token[0])
        self.current = target

    def home(self) -> None:
        """Back to the identity."""
        if self.current:
            changed = self.token[0] if self.token is not None else []
            self.models.dirty.update(self.mover.undo(self.current, (changed, self.token[1] if not self.direct else {})))
            self.current, self.token = {}, None


def shares_chain(problem: Problem, names: set[str]) -> bool:
    """Do these space instances share a factor chain (one segment) with other spaces?"""
    for p in problem.params.values():
        for a in p.axes:
            for s in a.segments:
                here = {f.space for f in s.factors}
                if here & names and here - names:
                    return True
    return False
