"""symspec: weight-space symmetries of Transformers.

Declare a model's symmetry groups in a YAML spec, check that they preserve the
function, align models with any registered method (``symspec.align``) and merge them.

The public surface is re-exported here and imported lazily, so that ``symspec --help``
stays fast:

>>> import symspec
>>> spec = symspec.load_spec("nanogpt")
>>> [s.key for s in spec.spaces]
['resid', 'ff[i]', 'attn[i]']
"""

from __future__ import annotations

from ._lazy import lazy_exports
from ._version import __version__

_EXPORTS = {
    "load_spec": "symspec.spec.load",
    "loads_spec": "symspec.spec.load",
    "dump_spec": "symspec.spec.load",
    "Spec": "symspec.spec.model",
    "bind": "symspec.binding",
    "BoundSpec": "symspec.binding",
    "Problem": "symspec.problem",
    "check": "symspec.checker",
    "CheckReport": "symspec.checker",
    "align": "symspec.alignment",
    "AlignResult": "symspec.alignment",
    "method_names": "symspec.alignment",
    "register_method": "symspec.alignment",
    "universe_match": "symspec.universe",
    "UniverseResult": "symspec.universe",
    "apply_elements": "symspec.transforms",
    "sample_elements": "symspec.transforms",
    "canonicalize_model": "symspec.transforms",
    "canonicalize_state_dict": "symspec.transforms",
    "plant": "symspec.planting",
    "PlantedCopy": "symspec.planting",
    "parse_group": ("symspec.groups", "parse"),
    "infer": "symspec.inference",
    "lift": "symspec.width",
    "InferResult": "symspec.inference",
    "SymspecError": "symspec.errors",
    "SymspecInputError": "symspec.errors",
    "SpecError": "symspec.errors",
    "BindError": "symspec.errors",
}

# Function names never collide with module names (``symspec.check`` is the function,
# ``symspec.checker`` its module; ``symspec.bind`` / ``symspec.binding``): importing a
# submodule sets it as an attribute of the package, which would shadow a function
# exported under the same name.
_SUBMODULES = ("groups", "spec", "testing", "transforms", "graph", "problem", "errors", "loading",
               "binding", "checker", "alignment", "universe", "record", "solvers", "analyzers",
               "inference", "width", "learned", "certify", "canonical", "data", "runtime")

__getattr__, _names = lazy_exports(__name__, _EXPORTS, _SUBMODULES)
__all__ = [*_names, "__version__"]
