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

import torch

from ..canonical import CanonicalizationError, CanonOp, untie_module

__all__ = [
    "Canonical",
    "CanonicalizationError",
    "canonicalize_model",
    "canonicalize_state_dict",
    "canonicalize_structure",
    "untie_module",
]


class Canonical(Protocol):
    """Anything that carries concrete canonicalisation steps (a BoundSpec does)."""

    @property
    def canonical(self) -> Sequence[CanonOp]: ...


def canonicalize_state_dict(bound: Canonical, state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The canonical form of a state dict (a new dict; the input is not modified)."""
    sd = dict(state_dict)
    for op in bound.canonical:
        op.impl.apply(op, sd)
    return sd


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
