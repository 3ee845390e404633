"""Models of different widths: lifting a narrower model into a wider one's shape
(:mod:`.lifting`; random maps, or fitted to the wider model: :mod:`.fit`), the first step
of width-heterogeneous alignment: :func:`symspec.align` lifts B when it is narrower; the
lift's free directions trained for the path after the alignment: :mod:`.free`. Both are
stages of ``align()`` (:mod:`.stages`), registered by :mod:`.extension`.

Names are imported on first use: registering the stages (when methods are listed) does
not import torch.
"""

from __future__ import annotations

from .._lazy import lazy_exports

__getattr__, __all__ = lazy_exports(__name__, {
    "fitted_lift": ".fit", "learn_free": ".free",
    "LiftError": ".lifting", "LiftResult": ".lifting", "SpaceLift": ".lifting", "check_lift": ".lifting",
    "lift": ".lifting", "lift_needed": ".lifting", "width_changes": ".lifting",
})
