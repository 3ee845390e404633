"""Progress of a universe run, as events for a progress bar or a log."""

from __future__ import annotations

import math
from collections.abc import Callable

import attrs


@attrs.frozen
class UniverseEvent:
    """Progress: ``kind`` is 'prepare' (a model loaded), 'align' (a model aligned),
    'round' (a round finished: ``objective``), 'learn' (a step of the learned refinement:
    ``done`` of ``total``, the step's loss as ``objective``) or 'note' (``message``)."""

    kind: str
    round: int = 0
    rounds: int = 0
    done: int = 0
    total: int = 0
    name: str = ""
    objective: float = math.nan
    seconds: float = 0.0
    message: str = ""


Progress = Callable[[UniverseEvent], None]


def quiet(event: UniverseEvent) -> None:
    """The progress callback that reports nothing."""


__all__ = ["Progress", "UniverseEvent", "quiet"]
