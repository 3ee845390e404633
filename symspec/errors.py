"""One typed error hierarchy for everything a user can get wrong.

The CLI maps these to exit codes: :class:`SymspecInputError` (and its subclasses) is
bad input, exit 2; a failed check is not an exception but a report, exit 1.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Sequence

import attrs


@attrs.frozen
class Location:
    """Where a piece of a spec came from: file, 1-based line and column, and key path."""

    file: str = "<string>"
    line: int = 0
    col: int = 0
    path: str = ""

    def __str__(self) -> str:
        where = f"{self.file}:{self.line}:{self.col}" if self.line else self.file
        return f"{where}: {self.path}" if self.path else where

    def child(self, key: str | int) -> Location:
        return attrs.evolve(self, path=join_path(self.path, key))


def join_path(path: str, key: str | int) -> str:
    """Key paths read like ``spaces.ff.group`` or ``params[transformer.h.{i}.ln_1.weight][0]``."""
    if isinstance(key, int):
        return f"{path}[{key}]"
    if "." in key or "{" in key or " " in key:
        return f"{path}[{key}]"
    return f"{path}.{key}" if path else key


@attrs.frozen
class Diagnostic:
    loc: Location
    message: str
    hint: str | None = None

    def __str__(self) -> str:
        text = f"{self.loc}: {self.message}"
        if self.hint:
            text += f"; {self.hint}"
        return text


class SymspecError(Exception):
    """Base of every error symspec raises on purpose."""


class SymspecInputError(SymspecError):
    """Bad input: a file, a spec, a model or an argument that cannot be used (exit code 2)."""


class DiagnosticsError(SymspecInputError):
    """Several located problems at once (all errors of a spec file, of a binding, ...)."""

    def __init__(self, diagnostics: Sequence[Diagnostic], headline: str = "") -> None:
        self.diagnostics = tuple(diagnostics)
        self.headline = headline
        super().__init__(self.render())

    def render(self) -> str:
        lines = [self.headline] if self.headline else []
        lines += [str(d) for d in self.diagnostics]
        return "\n".join(lines)


class SpecError(DiagnosticsError):
    """A spec file that is malformed or inconsistent."""


class BindError(DiagnosticsError):
    """A spec that does not fit a model (missing parameters, wrong shapes, unbound parameters)."""


class GroupError(SymspecInputError):
    """A group expression that cannot be parsed or instantiated."""


class ModelLoadError(SymspecInputError):
    """A model file, folder or checkpoint that cannot be loaded."""


def suggest(name: str, candidates: Iterable[str], n: int = 1, aliases: dict[str, str] | None = None) -> str | None:
    """A 'did you mean' hint for ``name`` among ``candidates`` (None when nothing is close).

    >>> suggest("Orth", ["O", "GL", "S"])
    "did you mean 'O'?"
    >>> suggest("zzz", ["O", "GL"]) is None
    True
    """
    cands = list(dict.fromkeys(candidates))
    if aliases and name in aliases and aliases[name] in cands:
        return f"did you mean '{aliases[name]}'?"
    close = difflib.get_close_matches(name, cands, n=n, cutoff=0.6)
    if not close:
        lower = name.lower()
        close = [c for c in cands if len(c) >= 1 and (lower.startswith(c.lower()) or c.lower().startswith(lower))]
        close = sorted(close, key=lambda c: -len(c))[:n]
    if not close:
        close = difflib.get_close_matches(name, cands, n=n, cutoff=0.4)
    if not close:
        return None
    if len(close) == 1:
        return f"did you mean '{close[0]}'?"
    return "did you mean one of " + ", ".join(f"'{c}'" for c in close) + "?"
