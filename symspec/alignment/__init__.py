"""Alignment: every method a peer in one registry, one pipeline around them.

- :mod:`.method`: what a method is (:class:`Method`) and what it is given and returns
  (:class:`Endpoint`, :class:`AlignOptions`, :class:`Alignment`);
- :mod:`.registry`: which methods exist (:func:`register_method`, :func:`get_method`,
  :func:`method_names`; plugins through the ``symspec.methods`` entry points);
- :mod:`.methods`: the built-in ones (``none``, ``weight``, ``weight-perm``,
  ``universe``, the data-driven :mod:`.activation` ones, :mod:`.learned`);
- :mod:`.api`: :func:`align`, the pipeline every method runs in (bind, check,
  canonicalise, restrict, solve, transform, record), and its :class:`AlignResult`.

Names are imported on first use, so that listing the methods (the CLI's help) does not
import torch. See docs/architecture.md for how to add a method.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "AlignOptions": "method", "Alignment": "method", "Endpoint": "method", "Method": "method",
    "get_method": "registry", "method_names": "registry", "register_method": "registry",
    "registered": "registry", "unregister_method": "registry",
    "AlignResult": "api", "align": "api", "canonical_module": "api", "check_same_problem": "api",
    "mode_text": "api", "weight_distance": "api", "DATA_DEFAULT": "methods",
    "ActivationOptions": "activation", "LearnedOptions": "learned",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'symspec.alignment' has no attribute '{name}'")
    value = getattr(importlib.import_module(f"symspec.alignment.{module}"), name)
    globals()[name] = value
    return value
