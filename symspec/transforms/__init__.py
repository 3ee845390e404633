"""Transforms: group elements acting on state dicts, and canonicalisation passes."""

from .apply import apply_elements, inverse_elements, sample_elements, transform_tensor
from .canonical import STEP_IMPLS, canonicalize_model, canonicalize_state_dict
from .planting import PlantedCopy, plant

__all__ = [
    "STEP_IMPLS",
    "PlantedCopy",
    "apply_elements",
    "canonicalize_model",
    "canonicalize_state_dict",
    "inverse_elements",
    "plant",
    "sample_elements",
    "transform_tensor",
]
