"""Canonicalisation of state dicts and models: the bound steps of a spec, applied in order.

The steps themselves (one class per kind) live in :mod:`symspec.canonical`. The
functions here act on state dicts (pure: a new dict) and on models (a deep copy of the
same class, with the canonical weights loaded); they need only the concrete steps, which
a :class:`~symspec.binding.BoundSpec` carries as ``canonical``.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from typing import Protocol

import attrs
import torch

from ..canonical import CanonicalizationError, CanonOp, untie_module

__all__ = [
    "Canonical",
    "CanonicalizationError",
    "Unfolded",
    "canonicalize_model",
    "canonicalize_state_dict",
    "canonicalize_structure",
    "unfold_norms",
    "untie_module",
]


class Canonical(Protocol):
    """Anything that carries concrete canonicalisation steps (a BoundSpec does)."""

    @property
    def canonical(self) -> Sequence[CanonOp]: ...


def canonicalize_state_dict(bound: Canonical, state_dict: Mapping[str, torch.Tensor], *,
                            in_place: bool = False) -> dict[str, torch.Tensor]:
    """The canonical form of a state dict (a new dict; the input is not modified). With
    ``in_place``, ``state_dict`` (a dict its caller owns) is the one rewritten and returned:
    its tensors are still never modified, but an entry a step replaces is let go at once,
    so that a model's old and new values are not both held."""
    sd = state_dict if in_place and isinstance(state_dict, dict) else dict(state_dict)
    for op in bound.canonical:
        op.impl.apply(op, sd)
    return sd


@attrs.frozen
class Unfolded:
    """What :func:`unfold_norms` gives: the state dict, the norms unfolded (their gains'
    names) and a note for every step it could not undo or left as it is."""

    state_dict: dict[str, torch.Tensor]
    unfolded: list[str]
    notes: list[str]


def unfold_norms(bound: Canonical, state_dict: Mapping[str, torch.Tensor],
                 reference: Mapping[str, torch.Tensor]) -> Unfolded:
    """``state_dict`` (canonical form: an aligned or merged model) with its norms unfolded
    using ``reference``'s gains and biases (model A's raw weights): every ``fold_norm`` step
    is undone, the last first (:meth:`~symspec.canonical.FoldNorm.undo`: a reader ``W``
    becomes ``W diag(1 / g_A)`` and the norm's weight ``g_A``; a folded LayerNorm bias
    moves back out of the readers' biases). Exactly function-preserving for any gain
    without zeros; where a step cannot be undone (a zero gain) the norm stays folded and
    a note says so, as for parameters that stay untied. Centred writers stay centred (the
    mean they lost carried no function). A new dict; the inputs are not modified.

    >>> import torch
    >>> from symspec.canonical import CanonOp
    >>> op = CanonOp("fold_norm", {"gain": "g", "bias": None, "into": [{"weight": "w", "axis": 1, "bias": None}]})
    >>> class Bound:
    ...     canonical = (op,)
    >>> raw = {"g": torch.tensor([2.0, 4.0]), "w": torch.ones(1, 2)}
    >>> folded = canonicalize_state_dict(Bound(), raw)
    >>> folded["g"].tolist(), folded["w"].tolist()
    ([1.0, 1.0], [[2.0, 4.0]])
    >>> back = unfold_norms(Bound(), folded, raw)
    >>> back.state_dict["g"].tolist(), back.state_dict["w"].tolist(), back.unfolded
    ([2.0, 4.0], [[1.0, 1.0]], ['g'])
    """
    sd = dict(state_dict)
    unfolded: list[str] = []
    notes: list[str] = []
    if not any(op.kind == "fold_norm" for op in bound.canonical):
        notes.append("the spec folds no norm (no fold_norm step): nothing to unfold")
    for op in reversed(list(bound.canonical)):
        note = op.impl.undo(op, sd, reference)
        if note:
            notes.append(note)
        elif op.kind == "fold_norm":
            unfolded.append(op.impl.subject(op))
    return Unfolded(sd, unfolded[::-1], notes[::-1])


def canonicalize_structure(bound: Canonical, model: torch.nn.Module) -> None:
    """Give ``model`` (in place) the structure of its canonical form: the parameters the
    steps untie get their own storage. The values are left as they are."""
    for op in bound.canonical:
        op.impl.apply_module(op, model)


def canonicalize_model(bound: Canonical, model: torch.nn.Module) -> torch.nn.Module:
    """A deep copy of ``model`` (same class) in canonical form, with the same function."""
    out = copy.deepcopy(model)
    canonicalize_structure(bound, out)
    sd = canonicalize_state_dict(bound, {k: v.detach() for k, v in model.state_dict().items()})
    out.load_state_dict(sd)
    return out
