"""Progress messages that say how far a long step is.

The core reports progress through a plain callback, ``progress(message)``. A message is
a :class:`Step`: a ``str`` (a callback that prints it works unchanged) that may also
carry ``done`` of ``total`` units of work, from which a progress bar, or a log line
where no terminal shows one, can tell how far the step is and how long is left.

>>> s = Step("sample 1/3: ff", done=4, total=12)
>>> s, s.done, s.total
('sample 1/3: ff', 4, 12)
>>> Step.of("canonicalising").total is None
True
>>> Step.of(s, prefix="round 2: "), Step.of(s, prefix="round 2: ").done
('round 2: sample 1/3: ff', 4)
"""

from __future__ import annotations

from collections.abc import Callable


class Step(str):
    """A progress message with, where known, ``done`` of ``total`` units of work
    (``done`` counts the units finished before the one the message announces)."""

    done: int | None
    total: int | None

    def __new__(cls, text: str, done: int | None = None, total: int | None = None) -> Step:
        obj = super().__new__(cls, text)
        obj.done, obj.total = done, total
        return obj

    @classmethod
    def of(cls, message: str, prefix: str = "") -> Step:
        """``message`` as a Step (keeping its counts when it is one), after ``prefix``."""
        return cls(prefix + str(message), getattr(message, "done", None), getattr(message, "total", None))


#: a callback that receives progress messages (a plain ``str`` or a :class:`Step`)
Progress = Callable[[str], None]


def quiet(message: str) -> None:
    """The progress callback that reports nothing."""


__all__ = ["Progress", "Step", "quiet"]
