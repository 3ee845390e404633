"""Checks before any work: an output must not be, contain or lie inside an input, an existing
one needs ``--force``, the folder it goes into must be writable and the name short enough;
staging folders that interrupted runs left are named."""

from __future__ import annotations

import errno
import json
import os
import socket
from collections.abc import Iterable, Sequence
from pathlib import Path

from ..errors import SymspecInputError
from .base import MARKER, NAME_MAX, PATH_MAX, STAGING_PREFIX, Target


def _resolved(p: str | Path) -> Path:
    return Path(os.path.realpath(os.path.abspath(p)))


def existing_inputs(items: Iterable[str | Path | None]) -> list[Path]:
    """The items that name existing files or folders (a built-in spec name or a data
    kind is not a path)."""
    return [Path(p) for p in items if p is not None and str(p) != "" and os.path.lexists(p)]


def _name_max(folder: Path) -> int:
    try:
        return int(os.pathconf(folder, "PC_NAME_MAX"))
    except (OSError, ValueError):
        return NAME_MAX


def _path_max(folder: Path) -> int:
    try:
        return int(os.pathconf(folder, "PC_PATH_MAX"))
    except (OSError, ValueError):
        return PATH_MAX


def check_overlap(path: str | Path, option: str, inputs: Iterable[str | Path]) -> None:
    """Refuse an output that is, contains or lies inside one of ``inputs`` (symlinks
    resolved): writing it would replace or change an input, ``--force`` or not."""
    out = _resolved(path)
    for given in existing_inputs(inputs):
        inp = _resolved(given)
        if out == inp:
            raise SymspecInputError(f"{option} {path} is the input {given}; refusing to write over an input")
        if inp.is_relative_to(out):
            raise SymspecInputError(f"{option} {path} contains the input {given}; refusing to write over an input")
        if inp.is_dir() and out.is_relative_to(inp):
            raise SymspecInputError(f"{option} {path} lies inside the input {given}; refusing to write into an input")


def check_outputs(targets: Sequence[Target], inputs: Iterable[str | Path | None], *, force: bool,
                  flag: str = "--force") -> list[str]:
    """Fail before any work when an output cannot or must not be written; returns notes
    about staging folders that interrupted runs left next to the outputs."""
    inputs = existing_inputs(inputs)
    seen: dict[Path, Target] = {}
    for t in targets:
        if t.path.name in ("", ".", ".."):
            raise SymspecInputError(f"{t.option} {t.path}: give the name of a {'folder' if t.folder else 'file'} to write")
        check_overlap(t.path, t.option, inputs)
        key = _resolved(t.path)
        if key in seen:
            raise SymspecInputError(f"{seen[key].option} and {t.option} name the same file {t.path}")
        seen[key] = t
        if not t.folder and os.path.isdir(t.path):
            raise SymspecInputError(f"cannot write {t.path}: it is a folder")
        if os.path.lexists(t.path) and not force:
            raise SymspecInputError(f"{t.path} exists; refusing to overwrite it (use {flag})")
        _check_writable(t.path)
    notes: list[str] = []
    for folder in dict.fromkeys(_resolved(t.path).parent for t in targets):
        notes += stale_staging(folder)
    return notes


def _check_writable(path: Path) -> None:
    """The nearest existing folder above ``path`` must be a writable folder, and every
    name still to be created short enough for the file system."""
    absolute = Path(os.path.abspath(path))
    probe, missing = absolute.parent, [absolute.name]
    while not os.path.exists(probe) and probe != probe.parent:
        missing.append(probe.name)
        probe = probe.parent
    if not os.path.isdir(probe):
        raise SymspecInputError(f"cannot write {path}: {probe} is not a folder")
    if not os.access(probe, os.W_OK | os.X_OK):
        reason = os.strerror(errno.EROFS if _read_only(probe) else errno.EACCES)
        raise SymspecInputError(f"cannot write {path}: {probe} is not writable ({reason})")
    limit = _name_max(probe)
    if any(len(os.fsencode(name)) > limit for name in missing):
        raise SymspecInputError(f"cannot write {path}: {os.strerror(errno.ENAMETOOLONG)}")
    # the whole path, and its staged twin (built under the same parent), must fit PATH_MAX
    staged = os.path.join(absolute.parent, f"{STAGING_PREFIX}{'x' * 8}", "output" + absolute.suffix[:16])
    longest = max(len(os.fsencode(absolute)), len(os.fsencode(staged)))
    if longest >= _path_max(probe):
        raise SymspecInputError(f"cannot write {path}: {os.strerror(errno.ENAMETOOLONG)} (the whole path is longer "
                                f"than the system allows, {_path_max(probe)} bytes); write it under a shorter path")


def _read_only(folder: Path) -> bool:
    """Whether ``folder`` lies on a file system mounted read-only."""
    try:
        return bool(os.statvfs(folder).f_flag & os.ST_RDONLY)
    except (OSError, AttributeError):
        return False


def stale_staging(folder: str | Path) -> list[str]:
    """One note per staging folder in ``folder`` whose process is gone (killed while it
    wrote its outputs): they are never renamed into place, so they only take space."""
    notes = []
    try:
        entries = sorted(Path(folder).iterdir())
    except OSError:
        return []
    for entry in entries:
        if not entry.name.startswith(STAGING_PREFIX) or entry.is_symlink() or not entry.is_dir():
            continue
        info = _read_marker(entry)
        if info is not None and _alive(info):
            continue  # another command is writing it right now
        what = f" (writing {info['target']})" if info and info.get("target") else ""
        notes.append(f"{entry} is left from an interrupted run{what}; nothing uses it, remove it")
    return notes


def _read_marker(staging: Path) -> dict[str, object] | None:
    try:
        fd = os.open(staging / MARKER, os.O_RDONLY | os.O_NOFOLLOW)
        with os.fdopen(fd) as f:
            data = json.load(f)
        return data if isinstance(data, dict) else None
    except (OSError, ValueError):
        return None


def _alive(info: dict[str, object]) -> bool:
    pid = info.get("pid")
    if info.get("host") != socket.gethostname() or not isinstance(pid, int):
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
