"""Models of different widths: lifting a narrower model into a wider one's shape
(:mod:`.lifting`), the first step of width-heterogeneous alignment."""

from .lifting import LiftError, LiftResult, SpaceLift, check_lift, lift

__all__ = ["LiftError", "LiftResult", "SpaceLift", "check_lift", "lift"]
