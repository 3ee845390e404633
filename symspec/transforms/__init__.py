"""Transforms: group elements acting on state dicts, and canonicalisation passes.

They see the typed problem and the concrete canonicalisation steps, never the spec or the
binding (planted copies, which bind a spec first, are :mod:`symspec.planting`)."""

from .apply import (
    apply_elements,
    inverse_elements,
    reversed_binding,
    reversed_problem,
    sample_elements,
    transform_tensor,
)
from .canonicalize import Unfolded, canonicalize_model, canonicalize_state_dict, unfold_norms

__all__ = [
    "Unfolded",
    "apply_elements",
    "canonicalize_model",
    "canonicalize_state_dict",
    "inverse_elements",
    "reversed_binding",
    "reversed_problem",
    "sample_elements",
    "transform_tensor",
    "unfold_norms",
]
