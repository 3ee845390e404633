"""Universe matching's errors: models that cannot be matched together, and failed tasks."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ..errors import SymspecInputError


class UniverseError(SymspecInputError):
    """Models that cannot be matched together, or a run that failed (exit code 2)."""


class WorkerError(UniverseError):
    """One or more models whose task failed (their worker raised or died); the other
    models' results are kept in the work folder, so a rerun resumes."""

    def __init__(self, message: str, failures: Sequence[Mapping[str, Any]]) -> None:
        super().__init__(message)
        self.failures = [dict(f) for f in failures]


def raise_failures(failures: Sequence[Mapping[str, Any]], phase: str, work: Path, temporary: bool) -> None:
    """Raise a :class:`WorkerError` naming every failed model of ``phase`` ("loading",
    "round 3"), if any; a kept work folder is named for the rerun that resumes."""
    if not failures:
        return
    failures = sorted(failures, key=lambda f: f["index"])
    lines = [f"  {f['error']}" if str(f["error"]).startswith(f["name"]) else f"  {f['name']}: {f['error']}" for f in failures]
    if all(f.get("input") for f in failures) and phase == "loading":
        head = f"{len(failures)} model(s) cannot be matched:"
    else:
        head = f"{len(failures)} model(s) failed in {phase}:"
    tail = "" if temporary or phase == "loading" else f"\n  the other models' results are kept in {work}; rerun the same command to resume"
    raise WorkerError("\n".join([head, *lines]) + tail, failures)


__all__ = ["UniverseError", "WorkerError", "raise_failures"]
