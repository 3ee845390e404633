"""Alignment: every method a peer in one registry, one pipeline around them.

- :mod:`.protocol`: what a method is (:class:`Method`) and what it is given and returns
  (:class:`Endpoint`, :class:`AlignOptions`, :class:`Alignment`);
- :mod:`.registry`: which methods exist (:func:`register_method`, :func:`get_method`,
  :func:`method_names`; plugins through the ``symspec.methods`` entry points, symspec's
  own extensions through ``symspec.extensions``);
- :mod:`.builtin`: the built-in ones (``none``, ``weight``, ``weight-perm``, the
  data-driven :mod:`.activation` ones, and :mod:`.auto`, which tries the candidates and
  keeps the best); ``universe`` and ``learned`` are registered by their own packages;
- :mod:`.api`: :func:`align`, a chain of stages (:mod:`.stages`: bind, check,
  canonicalise, restrict, run the method, embed, transform, record) with the hooks
  extensions add (:mod:`.hooks`: stages before and after, the certifier), and its
  :class:`AlignResult` (:mod:`.result`).

Names are imported on first use, so that listing the methods (the CLI's help) does not
import torch. See docs/architecture.md for how to add a method.
"""

from __future__ import annotations

from .._lazy import lazy_exports

__getattr__, __all__ = lazy_exports(__name__, {
    "AlignOptions": ".protocol", "Alignment": ".protocol", "Endpoint": ".protocol", "Method": ".protocol",
    "get_method": ".registry", "method_names": ".registry", "register_method": ".registry",
    "registered": ".registry", "unregister_method": ".registry",
    "AlignRequest": ".hooks", "register_pre_stage": ".hooks", "register_post_stage": ".hooks",
    "register_certifier": ".hooks",
    "align": ".api", "check_same_problem": ".stages",
    "AlignResult": ".result", "canonical_module": ".result", "mode_text": ".result", "weight_distance": ".result",
    "no_certificate": ".result",
    "DATA_DEFAULT": ".builtin", "ActivationOptions": ".activation", "AutoOptions": ".auto",
    "candidate_names": ".auto",
})
