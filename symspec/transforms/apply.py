"""Apply group elements (one per space) to a state dict, returning a new one.

The input is never modified. Tensors that no given element touches are passed through
(the same tensor objects); everything else is new.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import attrs
import torch

from ..groups import Element, Path, Variance
from ..problem import ParamBinding, Problem
from ..statedict import storage_key

#: a dense action in place of a group's ``apply``: ``action(x, path, variance) -> y``
Action = Callable[[torch.Tensor, Path, Variance], torch.Tensor]


def transform_tensor(problem: Problem, binding: ParamBinding, x: torch.Tensor,
                     elements: Mapping[str, Element], actions: Mapping[str, Action] | None = None) -> torch.Tensor:
    """The transformed value of one bound parameter (spaces without an element: identity).
    ``actions``: per space, a callable ``(x, path, variance) -> y`` used instead of the
    group's ``apply`` (learned matching's soft and straight-through permutations)."""
    if binding.view is not None and any(f.space in elements or (actions and f.space in actions)
                                        for ab in binding.axes for s in ab.segments for f in s.factors):
        plain = attrs.evolve(binding, view=None)
        return binding.stored(transform_tensor(problem, plain, binding.viewed(x), elements, actions))
    for ab in binding.axes:
        if not any(f.space in elements or (actions and f.space in actions) for s in ab.segments for f in s.factors):
            continue
        moved = x.movedim(ab.axis, 0)
        if ab.layout is not None:  # a head-major axis: act in the concatenated order
            moved = ab.layout.to_concat(moved)
        pieces = []
        for seg in ab.segments:
            y = moved[seg.start : seg.stop]
            for f in reversed(seg.factors):
                act = actions.get(f.space) if actions else None
                if act is not None:
                    y = act(y, f.path, f.variance)
                    continue
                e = elements.get(f.space)
                if e is None:
                    continue
                group = problem.spaces[f.space].group
                y = group.apply(e, y, f.path, f.variance)  # type: ignore[arg-type]
            pieces.append(y)
        moved = pieces[0] if len(pieces) == 1 else torch.cat(pieces, 0)
        if ab.layout is not None:
            moved = ab.layout.to_storage(moved)
        x = moved.movedim(0, ab.axis)
    return x


def apply_elements(problem: Problem, elements: Mapping[str, Element],
                   state_dict: Mapping[str, torch.Tensor],
                   actions: Mapping[str, Action] | None = None) -> dict[str, torch.Tensor]:
    """Act with ``elements`` (space instance name -> element) on ``state_dict``
    (``actions``: see :func:`transform_tensor`). Differentiable in the elements' floating
    fields and in the state dict.

    Tied entries (``problem.ties``) that arrive as one shared tensor leave as one
    shared tensor.
    """
    unknown = set(elements) - set(problem.spaces)
    if unknown:
        raise KeyError(f"no such space(s): {', '.join(sorted(unknown))}")
    out = dict(state_dict)
    done: dict[tuple[object, ...], torch.Tensor] = {}
    tie_of = {n: g for g in problem.ties for n in g}
    for name, binding in problem.params.items():
        if name not in state_dict:
            continue
        if not binding.spaces() & (set(elements) | set(actions or ())):
            continue
        src = state_dict[name]
        key = storage_key(src)
        if name in tie_of and key in done:
            out[name] = done[key]
            continue
        y = transform_tensor(problem, binding, src, elements, actions)
        out[name] = y.contiguous() if y is not src else y.clone()
        if name in tie_of:
            done[key] = out[name]
    return out


def reversed_binding(binding: ParamBinding) -> ParamBinding:
    """The binding whose factor chains (``mlp[i] @ scale[i]``) run backwards: with inverse
    elements it undoes ``binding`` ((A B)^-1 = B^-1 A^-1)."""
    axes = tuple(attrs.evolve(ab, segments=tuple(attrs.evolve(s, factors=s.factors[::-1]) for s in ab.segments))
                 for ab in binding.axes)
    return attrs.evolve(binding, axes=axes)


def reversed_problem(problem: Problem) -> Problem:
    """``problem`` with every binding's factor chains reversed (:func:`reversed_binding`):
    applying inverse elements with it undoes applying the elements with ``problem``."""
    return attrs.evolve(problem, params={n: reversed_binding(pb) for n, pb in problem.params.items()})


def inverse_elements(problem: Problem, elements: Mapping[str, Element]) -> dict[str, Element]:
    return {k: problem.spaces[k].group.inverse(v) for k, v in elements.items()}


def sample_elements(problem: Problem, spaces: list[str] | None = None, seed: int = 0,
                    dtype: torch.dtype = torch.float64, cond: float = 10.0) -> dict[str, Element]:
    """One random element per space (all spaces by default), seeded per space."""
    names = list(problem.spaces) if spaces is None else spaces
    gen = torch.Generator().manual_seed(seed)
    return {n: problem.spaces[n].group.sample(gen, dtype=dtype, cond=cond) for n in names}
