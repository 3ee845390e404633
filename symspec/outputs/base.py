"""What every writer of outputs shares: the names of staging and temporary siblings, the modes
of published files, a :class:`Target`, write failures as one line, signals held while a
step makes something and records it, and parent folders made so that they can be removed."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from ..errors import SymspecInputError

#: staging folders are named this prefix and a random part: short enough beside any
#: legal output name, and recognisable, so that stale ones can be listed
STAGING_PREFIX = ".symspec-staging-"
#: temporary files and folders of :func:`atomic_write`
TMP_PREFIX = ".symspec-tmp-"
#: inside a staging folder: which output it builds, for which process
MARKER = "staging.json"
NAME_MAX = 255
PATH_MAX = 4096


def umask() -> int:
    """The process's umask. Linux shows it in /proc; elsewhere it is read by setting it
    and putting it back (briefly wrong for other threads, hence the /proc route first)."""
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def file_mode() -> int:
    """The mode of a published file: what ``open()`` would give, ``0o666 & ~umask``."""
    return 0o666 & ~umask()


def folder_mode() -> int:
    return 0o777 & ~umask()


@dataclass(frozen=True)
class Target:
    """One output of a command: its path, the option that named it (for messages) and
    whether it is a folder."""

    path: Path
    option: str
    folder: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "path", Path(self.path))


#: write failures that are not ``OSError``: safetensors reports a full disk as its own
#: error type (checked by module and name: safetensors need not be imported here)
_WRITE_ERRORS = {("safetensors", "SafetensorError")}


def is_write_error(e: BaseException) -> bool:
    t = type(e)
    return isinstance(e, OSError) or any(t.__module__.startswith(m) and t.__name__ == n for m, n in _WRITE_ERRORS)


#: safetensors reports an OS error as ``... I/O error: REASON (os error N)`` or
#: ``IoError(Os { code: N, ... })``: the number is the system's errno
_OS_ERROR = re.compile(r"os error (\d+)|code: (\d+)")


def error_number(e: BaseException) -> int | None:
    """The system's errno behind ``e``: an ``OSError``'s own, or the one safetensors
    names in its message; None where there is none."""
    if isinstance(e, OSError):
        return e.errno
    found = _OS_ERROR.search(str(e))
    return int(found.group(1) or found.group(2)) if found else None


def write_error(path: str | Path, e: BaseException) -> SymspecInputError:
    """``cannot write PATH: REASON`` on one line; an error safetensors wraps gives the
    system's own reason for its errno (in either of safetensors' wordings).

    >>> str(write_error("out", OSError(28, "No space left on device", "out/.x")))
    'cannot write out: No space left on device'
    >>> str(write_error("out", RuntimeError("I/O error: No space left on device (os error 28)")))
    'cannot write out: No space left on device'
    """
    code = error_number(e)
    if isinstance(e, OSError) and e.strerror:
        reason = e.strerror
    elif code is not None:
        reason = os.strerror(code)
    else:
        reason = str(e) or type(e).__name__
    return SymspecInputError(f"cannot write {path}: {' '.join(reason.split())}")


class _Terminated(SystemExit):
    """SIGTERM while publishing: unwinds like an interrupt, so the staging is removed."""


@contextlib.contextmanager
def terminate_as_exit() -> Iterator[None]:
    """Turn SIGTERM into an exception while the block runs (main thread only, and only
    where nobody installed a handler of their own), so ``finally`` clauses run."""
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGTERM) != signal.SIG_DFL:
        yield
        return

    def handler(signum: int, frame: object) -> None:
        raise _Terminated(128 + signum)

    signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


@contextlib.contextmanager
def deferred_interrupts() -> Iterator[None]:
    """Hold Ctrl-C (and SIGTERM where a handler of ours turns it into an exception) while
    the block runs, and deliver it right after: a step that makes something and records
    it (a folder and the list of what to remove; a rename and its flag) is never cut in
    two, so a roll-back always knows what there is to undo. Python runs signal handlers in
    the main thread only, so elsewhere (and for a signal left to the system's default)
    nothing is held."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held: list[tuple[int, object]] = []
    saved: dict[int, Callable[[int, object], object]] = {}
    for signum in (signal.SIGINT, signal.SIGTERM):
        handler = signal.getsignal(signum)
        if callable(handler):
            saved[signum] = handler
            signal.signal(signum, lambda s, frame: held.append((s, frame)))
    try:
        yield
    finally:
        for signum, handler in saved.items():
            signal.signal(signum, handler)
        if held:
            signum, frame = held[0]
            saved[signum](signum, frame)  # raises KeyboardInterrupt (or our SIGTERM exit)


def make_parents(folder: Path, made: list[Path] | None = None) -> list[Path]:
    """Create ``folder`` and its missing parents; returns those made, outermost first.
    Each one is appended to ``made`` as soon as it exists (an interrupt or a failure
    further down leaves the caller a complete list to remove); without ``made``, a
    failure removes those this call made before it raises."""
    new: list[Path] = []
    todo: list[Path] = []
    p = Path(os.path.abspath(folder))
    while not os.path.lexists(p) and p != p.parent:
        todo.append(p)
        p = p.parent
    try:
        for q in reversed(todo):
            with deferred_interrupts():
                os.mkdir(q)
                new.append(q)
                if made is not None:
                    made.append(q)
    except BaseException:
        if made is None:
            remove_folders(new)
        raise
    return new


def remove_folders(made: Sequence[Path]) -> None:
    """Remove the (empty) folders in ``made``, innermost first; one not empty stays."""
    for folder in reversed(made):
        with contextlib.suppress(OSError):
            folder.rmdir()


def remove_path(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
