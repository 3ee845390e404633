"""Evaluation data and losses: moved to the core, :mod:`symspec.data` (re-exported here,
so that ``symspec.analyzers.data`` keeps working). New code imports ``symspec.data``."""

from __future__ import annotations

from symspec.data import *  # noqa: F403
from symspec.data import __all__ as __all__
from symspec.data.losses import default_accuracy_if_classes as _default_accuracy_if_classes  # noqa: F401
