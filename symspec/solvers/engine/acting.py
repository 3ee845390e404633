"""Acting on bound parameters with their spaces' elements, as weight matching needs it.

A parameter's axis is bound to segments, each acted on by a product of factors
(``factors[-1]`` acts first). Weight matching reads one space's incidence with the
factors acting after that space undone (:func:`segment`), and moves a parameter by new
elements (:func:`transform`), possibly by one space's change only, conjugated by the
factors acting after it. Head-major axes act in their concatenated order.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from ...groups import Element
from ...problem import Factor, Incidence, Problem, Segment


def undo_left(problem: Problem, y: torch.Tensor, left: tuple[Factor, ...], elements: Mapping[str, Element]) -> torch.Tensor:
    """``y`` with the factors ``left`` (acting after a space) undone."""
    for f in left:
        g = problem.spaces[f.space].group
        y = g.apply(g.inverse(elements[f.space]), y, f.path, f.variance)  # type: ignore[arg-type]
    return y


def redo_left(problem: Problem, y: torch.Tensor, left: tuple[Factor, ...], elements: Mapping[str, Element]) -> torch.Tensor:
    """The inverse of :func:`undo_left`."""
    for f in reversed(left):
        g = problem.spaces[f.space].group
        y = g.apply(elements[f.space], y, f.path, f.variance)  # type: ignore[arg-type]
    return y


def segment(problem: Problem, x: torch.Tensor, inc: Incidence, elements: Mapping[str, Element]) -> torch.Tensor:
    """The incidence's segment of ``x``, moved to the front, the factors acting after the
    space undone (at ``elements``), flattened to [n, m]."""
    y = inc.take(x.movedim(inc.axis, 0))
    y = undo_left(problem, y, inc.segment.factors[: inc.position], elements)
    return y.reshape(inc.segment.size, -1)


def _act(problem: Problem, seg: Segment, y: torch.Tensor, applied: Mapping[str, Element],
         current: Mapping[str, Element], only: str | None) -> torch.Tensor:
    if only is None:
        for f in reversed(seg.factors):
            g = problem.spaces[f.space].group
            y = g.apply(applied[f.space], y, f.path, f.variance)  # type: ignore[arg-type]
        return y
    for pos, f in enumerate(seg.factors):
        if f.space != only:
            continue
        left = seg.factors[:pos]
        y = undo_left(problem, y, left, current)
        g = problem.spaces[f.space].group
        y = g.apply(applied[only], y, f.path, f.variance)  # type: ignore[arg-type]
        y = redo_left(problem, y, left, current)
    return y


def transform(problem: Problem, p: str, x: torch.Tensor, applied: Mapping[str, Element],
              current: Mapping[str, Element] | None = None, only: str | None = None) -> torch.Tensor:
    """Parameter ``p`` (the tensor ``x``) acted on by ``applied``: every factor by its
    space's element, or with ``only``, just that space's factors by ``applied[only]``,
    each conjugated by the factors acting after it (at the ``current`` elements)."""
    pb = problem.params[p]
    cur = current if current is not None else applied
    for ab in pb.axes:
        if only is not None and not any(f.space == only for seg in ab.segments for f in seg.factors):
            continue
        moved = x.movedim(ab.axis, 0)
        if ab.layout is not None:  # a head-major axis: act in the concatenated order
            moved = ab.layout.to_concat(moved)
        pieces = [_act(problem, seg, moved[seg.start : seg.stop], applied, cur, only) for seg in ab.segments]
        moved = pieces[0] if len(pieces) == 1 else torch.cat(pieces, 0)
        if ab.layout is not None:
            moved = ab.layout.to_storage(moved)
        x = moved.movedim(0, ab.axis)
    return x


#: entries of a large tensor transformed at once by :func:`transform_in_place` (32 MB in float32)
IN_PLACE_CHUNK = 1 << 23


def transform_in_place(problem: Problem, p: str, x: torch.Tensor, applied: Mapping[str, Element]) -> torch.Tensor:
    """:func:`transform` written into ``x`` itself, a slice at a time along the largest axis
    no element of ``applied`` acts on (an embedding's rows); a tensor without such an axis,
    or small, is transformed whole (and returned new)."""
    pb = problem.params[p]
    moved = {ab.axis for ab in pb.axes if any(f.space in applied for seg in ab.segments for f in seg.factors)}
    free = [a for a in range(x.ndim) if a not in moved]
    if not free or x.numel() <= IN_PLACE_CHUNK:
        return transform(problem, p, x, applied)
    axis = max(free, key=lambda a: x.shape[a])
    step = max(1, IN_PLACE_CHUNK * x.shape[axis] // x.numel())
    for s in range(0, x.shape[axis], step):
        part = x.narrow(axis, s, min(step, x.shape[axis] - s))
        part.copy_(transform(problem, p, part, applied))
    return x
