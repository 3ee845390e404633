"""Universe matching's errors: models that cannot be matched together, and failed tasks."""

from __future__ import annotations

import errno
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ..errors import SymspecInputError
from ..outputs import error_number, write_error


class UniverseError(SymspecInputError):
    """Models that cannot be matched together, or a run that failed (exit code 2)."""


class WorkWriteError(UniverseError):
    """A file of the work folder could not be written (a full disk, a read-only folder):
    ``cannot write PATH: REASON``, one line. ``kind`` travels with a worker's failure
    (:func:`symspec.runtime.run_task`), so that the parent reports it as it is."""

    kind = "write"

    def __init__(self, message: str, code: int | None = None) -> None:
        super().__init__(message)
        self.code = code


def work_write_error(path: str | Path, e: BaseException) -> WorkWriteError:
    """``e`` (an ``OSError``, or safetensors' error wrapping one) as one line naming ``path``.

    >>> str(work_write_error("w/a", OSError(errno.ENOSPC, "No space left on device")))
    'cannot write w/a: No space left on device'
    """
    return WorkWriteError(str(write_error(path, e)), error_number(e))


def resume_hint(e: WorkWriteError, work: Path, kept: bool) -> str:
    """What to do after a failed write in the work folder ``work``: free space and rerun
    (the finished work is kept), or make the folder writable."""
    if e.code in (errno.EROFS, errno.EACCES, errno.EPERM):
        return f"; make {work} writable and rerun the same command, or remove it" if kept else ""
    if not kept:
        return "; free some space and rerun the same command"
    return f"; the finished work is kept in {work}: free some space and rerun the same command to resume"


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
    written = [f for f in failures if f.get("kind") == WorkWriteError.kind]
    if written:  # a full disk fails every task alike: one line, as in the parent
        raise WorkWriteError(str(written[0]["error"]), written[0].get("code"))
    lines = [f"  {f['error']}" if str(f["error"]).startswith(f["name"]) else f"  {f['name']}: {f['error']}" for f in failures]
    if all(f.get("input") for f in failures) and phase == "loading":
        head = f"{len(failures)} model(s) cannot be matched:"
    else:
        head = f"{len(failures)} model(s) failed in {phase}:"
    tail = "" if temporary or phase == "loading" else f"\n  the other models' results are kept in {work}; rerun the same command to resume"
    raise WorkerError("\n".join([head, *lines]) + tail, failures)


__all__ = ["UniverseError", "WorkWriteError", "WorkerError", "raise_failures", "resume_hint", "work_write_error"]
