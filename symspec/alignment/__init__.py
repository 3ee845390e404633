"""Alignment: every method a peer in one registry, one pipeline around them.

- :mod:`.method`: what a method is (:class:`Method`) and what it is given and returns
  (:class:`Endpoint`, :class:`AlignOptions`, :class:`Alignment`);
- :mod:`.registry`: which methods exist (:func:`register_method`, :func:`get_method`,
  :func:`method_names`; plugins through the ``symspec.methods`` entry points);
- :mod:`.methods`: the built-in ones (``none``, ``weight``, ``weight-perm``,
  ``universe``, the data-driven :mod:`.activation` ones, learned matching from
  :mod:`symspec.learned`);
- :mod:`.api`: :func:`align`, the pipeline every method runs in (bind, check,
  canonicalise, restrict, solve, transform, record), and its :class:`AlignResult`.

Names are imported on first use, so that listing the methods (the CLI's help) does not
import torch. See docs/architecture.md for how to add a method.
"""

from __future__ import annotations

from .._lazy import lazy_exports

__getattr__, __all__ = lazy_exports(__name__, {
    "AlignOptions": ".method", "Alignment": ".method", "Endpoint": ".method", "Method": ".method",
    "get_method": ".registry", "method_names": ".registry", "register_method": ".registry",
    "registered": ".registry", "unregister_method": ".registry",
    "AlignResult": ".api", "align": ".api", "canonical_module": ".api", "check_same_problem": ".api",
    "mode_text": ".api", "weight_distance": ".api", "DATA_DEFAULT": ".methods",
    "ActivationOptions": ".activation",
})
