"""Models of different widths: lifting a narrower model into a wider one's shape
(:mod:`.lifting`; random maps, or fitted to the wider model: :mod:`.fit`), the first step
of width-heterogeneous alignment: :func:`symspec.align` lifts B when it is narrower; the
lift's free directions trained for the path after the alignment: :mod:`.free`."""

from .fit import fitted_lift
from .free import learn_free
from .lifting import LiftError, LiftResult, SpaceLift, check_lift, lift, lift_needed, width_changes

__all__ = ["LiftError", "LiftResult", "SpaceLift", "check_lift", "fitted_lift", "learn_free", "lift", "lift_needed", "width_changes"]
