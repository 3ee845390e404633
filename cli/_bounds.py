"""Upper bounds of the options that set how long a command runs or how much it holds at
once. Without them ``--steps 2**64`` or ``--lift-free 10**12`` ran until killed; each
bound's error says why it is there, not only the range."""

from __future__ import annotations

from typing import Any

import click

from ._common import FiniteFloat
from .check import MAX_SEED

#: learned matching and the lift's free directions: each step is a forward and backward
#: pass of both models, so a million steps already take days on a small model
MAX_STEPS = 1_000_000
STEPS_WHY = "each step is a forward and backward pass of both models; more runs for weeks"
#: passes over the train split (--epochs), for the same reason
MAX_EPOCHS = 10_000
EPOCHS_WHY = "each epoch is a pass over the whole train split; more runs for weeks"
#: examples in one forward pass: more than this only exhausts memory
MAX_BATCH_SIZE = 65_536
BATCH_WHY = "examples in one forward pass; more only exhausts memory"


class _Why:
    """Mixin for click's ranges: a value above the range says why the range ends there."""

    why: str

    def fail_above(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> None:
        self.fail(f"{value} is more than {self.max}: {self.why}", param, ctx)  # type: ignore[attr-defined]


class BoundedInt(_Why, click.IntRange):
    """``click.IntRange(min, max)`` whose error for a too-large value gives ``why``."""

    def __init__(self, min: int, max: int, why: str) -> None:
        super().__init__(min, max)
        self.why = why

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        rv = click.INT.convert(value, param, ctx)
        if rv > self.max:  # type: ignore[operator]
            self.fail_above(rv, param, ctx)
        return super().convert(rv, param, ctx)


class BoundedFloat(_Why, FiniteFloat):
    """:class:`~symspec.cli._common.FiniteFloat` whose error above ``max`` gives ``why``."""

    def __init__(self, min: float, max: float, why: str) -> None:
        super().__init__(min, max)
        self.why = why

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        import math

        rv = click.FLOAT.convert(value, param, ctx)
        if math.isfinite(rv) and rv > self.max:  # type: ignore[operator]
            self.fail_above(rv, param, ctx)
        return super().convert(rv, param, ctx)


#: every command's --seed, with the one bound of cli/check.py (2**70 once failed deep in
#: torch with "Overflow when unpacking long long")
SEED = BoundedInt(0, MAX_SEED, "seeds are mixed into torch's 64-bit random generators")
STEPS = BoundedInt(1, MAX_STEPS, STEPS_WHY)
#: --lift-free N: steps too, 0 is off
LIFT_FREE_STEPS = BoundedInt(0, MAX_STEPS, STEPS_WHY)
EPOCHS = BoundedFloat(0, MAX_EPOCHS, EPOCHS_WHY)
BATCH_SIZE = BoundedInt(1, MAX_BATCH_SIZE, BATCH_WHY)
