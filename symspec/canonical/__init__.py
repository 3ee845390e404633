"""Canonicalisation steps: function-preserving rewrites that widen the usable group.

One class per step kind (:data:`STEPS`, keyed by the name a spec writes under
``canonicalize``; the kind's syntax is declared by the spec language,
:data:`symspec.spec.steps.STEP_KINDS`, which validates the YAML and writes the JSON Schema):
it binds to a model's parameter names and shapes (one :class:`CanonOp` per match), and
applies to a state dict and, where the structure changes (untie), to a module. Spec
loading, binding, the transforms and the checker all go through these classes.

>>> list(STEPS)
['untie', 'fold_norm', 'center']
"""

from .base import (
    STEPS,
    BindContext,
    CanonicalizationError,
    CanonOp,
    CanonStep,
    OwnedState,
    register,
    writable,
)
from .center import Center
from .fold_norm import FoldNorm
from .untie import Untie, untie_module

for _kind in (Untie, FoldNorm, Center):  # in the order error messages and the schema list them
    register(_kind)

__all__ = ["STEPS", "BindContext", "CanonOp", "CanonStep", "CanonicalizationError", "Center", "FoldNorm", "OwnedState",
           "Untie", "register", "untie_module", "writable"]
