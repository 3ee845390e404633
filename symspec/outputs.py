"""Writing outputs without ever losing data: the primitives every command uses.

- :func:`check_outputs`, before any work: an output must not be, contain or lie inside
  one of the command's inputs (symlinks resolved, with or without ``--force``); an
  existing output needs ``--force``; a report path must not be a folder; the folder it
  goes into must be writable and the name short enough. It also says which staging
  folders an interrupted run left behind.
- :func:`publish`: each output is built in a staging folder next to it (a short fixed
  prefix and a random part, whatever the output's name, with a marker naming the output
  and the process), then renamed into place once every output is complete. Any failure
  or interrupt (``KeyboardInterrupt``, SIGTERM while publishing) removes the staging
  folders, the outputs already renamed (putting back what ``--force`` replaced) and the
  parent folders it made. A write failure (``OSError``, safetensors' serialisation error
  on a full disk) becomes one line: ``cannot write OUT: No space left on device``.
  Published files get the usual modes, ``0o666 & ~umask`` (folders ``0o777 & ~umask``).
- :class:`FolderLock`: an exclusive ``flock`` on a folder (``universe``'s resumable work
  folder): a second run fails with "another run is using ...", and a killed run's lock
  goes with its process. A folder that is a symbolic link is never followed.
- :func:`atomic_write` (and :func:`atomic_write_bytes`, :func:`atomic_write_text`): one
  file or folder, built at a temporary sibling and renamed into place.

>>> import tempfile, pathlib
>>> d = pathlib.Path(tempfile.mkdtemp())
>>> out = d / "result"
>>> check_outputs([Target(out, "--out", folder=True)], inputs=[], force=False)
[]
>>> publish([(Target(out, "--out", folder=True), lambda p: (p / "a.txt").write_text("hi"))], force=False)
>>> sorted(x.name for x in d.iterdir()), (out / "a.txt").read_text()
(['result'], 'hi')
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import os
import re
import shutil
import signal
import socket
import stat
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from .errors import SymspecError, SymspecInputError

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


# --------------------------------------------------------------------------- checks


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


# --------------------------------------------------------------------------- publishing

#: write failures that are not ``OSError``: safetensors reports a full disk as its own
#: error type (checked by module and name: safetensors need not be imported here)
_WRITE_ERRORS = {("safetensors", "SafetensorError")}


def is_write_error(e: BaseException) -> bool:
    t = type(e)
    return isinstance(e, OSError) or any(t.__module__.startswith(m) and t.__name__ == n for m, n in _WRITE_ERRORS)


def write_error(path: str | Path, e: BaseException) -> SymspecInputError:
    """``cannot write PATH: REASON`` on one line (safetensors wraps the system's reason
    as ``IoError(Os { ..., message: "No space left on device" })``: that part is kept).

    >>> str(write_error("out", OSError(28, "No space left on device", "out/.x")))
    'cannot write out: No space left on device'
    """
    reason = (e.strerror if isinstance(e, OSError) and e.strerror else str(e)) or type(e).__name__
    wrapped = re.search(r'message: "([^"]+)"', reason)
    reason = " ".join((wrapped.group(1) if wrapped else reason).split())
    return SymspecInputError(f"cannot write {path}: {reason}")


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


def _make_parents(folder: Path, made: list[Path] | None = None) -> list[Path]:
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
            _remove_folders(new)
        raise
    return new


def _remove_folders(made: Sequence[Path]) -> None:
    """Remove the (empty) folders in ``made``, innermost first; one not empty stays."""
    for folder in reversed(made):
        with contextlib.suppress(OSError):
            folder.rmdir()


def new_staging(target: Path) -> Path:
    """A staging folder next to ``target``, with its marker. All or nothing: when the
    marker cannot be written (a full disk lets ``mkdir`` pass and then has no byte for
    the marker's text), the folder is removed before the error goes on."""
    staging = Path(tempfile.mkdtemp(prefix=STAGING_PREFIX, dir=Path(os.path.abspath(target)).parent))
    try:
        with open(staging / MARKER, "w") as f:
            json.dump({"target": str(os.path.abspath(target)), "pid": os.getpid(), "host": socket.gethostname(),
                       "started": time.time()}, f)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return staging


def _staged_name(target: Target) -> str:
    suffix = target.path.suffix
    return "output" + (suffix if 0 < len(suffix) <= 16 and not target.folder else "")


def normal_permissions(path: Path) -> None:
    """Staged files and folders are private (``mkstemp``/``mkdtemp``); give everything
    under ``path`` the modes a plain ``open()``/``mkdir()`` would have. Symlinks are
    skipped: ``chmod`` would follow them."""
    fmode, dmode = file_mode(), folder_mode()
    if path.is_symlink():
        return
    if not path.is_dir():
        os.chmod(path, fmode)
        return
    for root, dirs, names in os.walk(path):
        for n in names:
            p = Path(root) / n
            if not p.is_symlink():
                os.chmod(p, fmode)
        for d in dirs:
            p = Path(root) / d
            if not p.is_symlink():
                os.chmod(p, dmode)
    os.chmod(path, dmode)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


@dataclass
class _Item:
    target: Target
    fill: Callable[[Path], None]
    staging: Path | None = None
    aside: bool = False    # an existing output was moved into the staging folder
    placed: bool = False   # the new output is at its final name

    @property
    def built(self) -> Path:
        assert self.staging is not None
        return self.staging / _staged_name(self.target)

    @property
    def previous(self) -> Path:
        assert self.staging is not None
        return self.staging / "previous"


def publish(items: Sequence[tuple[Target, Callable[[Path], None]]], *, force: bool, flag: str = "--force") -> None:
    """Build every output with its ``fill(path)`` in a staging folder next to it (a
    folder output gets an empty folder, a file output a path to write), then rename them
    all into place. All or nothing: on any exception, interrupt included, nothing of this
    call is left, and outputs replaced under ``force`` are put back."""
    work = [_Item(t, fill) for t, fill in items]
    made: list[Path] = []
    current = work[0].target.path if work else Path()
    try:
        with terminate_as_exit():
            for it in work:
                current = it.target.path
                _make_parents(it.target.path.parent, made)
                with deferred_interrupts():  # the folder exists only once roll-back knows it
                    it.staging = new_staging(it.target.path)
                if it.target.folder:
                    it.built.mkdir()
                it.fill(it.built)
                if not os.path.lexists(it.built):
                    raise SymspecInputError(f"cannot write {it.target.path}: nothing was written")
                normal_permissions(it.built)
            for it in work:
                current = it.target.path
                if os.path.lexists(it.target.path):
                    if not force:
                        raise SymspecInputError(f"{it.target.path} exists; refusing to overwrite it (use {flag})")
                    with deferred_interrupts():  # moved aside and known to be: roll-back puts it back
                        os.rename(it.target.path, it.previous)  # never follows a symlink: the link itself moves
                        it.aside = True
                with deferred_interrupts():
                    os.rename(it.built, it.target.path)
                    it.placed = True
    except BaseException as e:
        _roll_back(work, made)
        if isinstance(e, SymspecError) or not is_write_error(e):
            raise
        raise write_error(current, e) from e
    with deferred_interrupts():  # published: an interrupt now leaves the outputs, not a half-removed staging
        for it in work:
            if it.staging is not None:
                shutil.rmtree(it.staging, ignore_errors=True)


def _roll_back(work: Sequence[_Item], made: Sequence[Path]) -> None:
    """Undo :func:`publish` as far as it went. A second Ctrl-C waits until it is done."""
    with deferred_interrupts():
        for it in reversed(work):
            with contextlib.suppress(OSError):
                if it.placed:
                    _remove(it.target.path)
                if it.aside:
                    os.rename(it.previous, it.target.path)
            if it.staging is not None:
                shutil.rmtree(it.staging, ignore_errors=True)
        _remove_folders(made)


def publish_bytes(targets: Sequence[tuple[Target, bytes]], *, force: bool, flag: str = "--force") -> None:
    """:func:`publish` for outputs that are bytes already."""

    def writer(data: bytes) -> Callable[[Path], None]:
        return lambda p: p.write_bytes(data)

    publish([(t, writer(data)) for t, data in targets], force=force, flag=flag)


# --------------------------------------------------------------------------- one file


def atomic_write(path: str | Path, write: Callable[[Path], None], *, folder: bool = False) -> None:
    """Build ``path`` at a temporary sibling with ``write(tmp)`` and rename it into place:
    the one atomic write. A file is made empty for ``write`` to fill and gets the usual
    mode, ``0o666 & ~umask``; a ``folder`` is made empty for ``write`` to fill and replaces
    whatever ``path`` held. The sibling's name is short and fixed-prefixed
    (:data:`TMP_PREFIX`), so any legal ``path`` works; a failure or an interrupt removes
    it and the parent folders made for it, and leaves what ``path`` held."""
    p = Path(path)
    made: list[Path] = []
    tmp: Path | None = None
    try:
        _make_parents(p.parent, made)
        with deferred_interrupts():  # made and known, or not made
            if folder:
                tmp = Path(tempfile.mkdtemp(prefix=TMP_PREFIX, dir=p.parent))
            else:
                fd, name = tempfile.mkstemp(prefix=TMP_PREFIX, dir=p.parent)
                os.close(fd)
                tmp = Path(name)
        write(tmp)
        if not folder:
            os.chmod(tmp, file_mode())
            os.replace(tmp, p)
        else:
            with deferred_interrupts():  # the old folder goes only once the new one is in place
                old = tmp.with_name(tmp.name + ".old") if os.path.lexists(p) else None
                if old is not None:
                    os.rename(p, old)
                try:
                    os.replace(tmp, p)
                except BaseException:
                    if old is not None:
                        os.rename(old, p)
                    raise
                if old is not None:
                    _remove(old)
    except BaseException:
        with deferred_interrupts():
            if tmp is not None:
                _remove(tmp)
            _remove_folders(made)
        raise


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically (:func:`atomic_write`), synced to disk."""

    def write(tmp: Path) -> None:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())

    atomic_write(path, write)


def atomic_write_text(path: str | Path, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


# --------------------------------------------------------------------------- work folders


def work_folder(out: str | Path) -> Path:
    """The resumable work folder of a run writing ``out``: ``.NAME.partial`` next to it,
    with NAME shortened (and a hash of it added) where that would pass the name limit."""
    out = Path(out)
    name = f".{out.name}.partial"
    if len(os.fsencode(name)) > NAME_MAX:
        digest = hashlib.sha256(os.fsencode(out.name)).hexdigest()[:12]
        keep = NAME_MAX - len(f"..{digest}.partial") - 1
        short = os.fsencode(out.name)[:keep].decode("utf-8", errors="ignore")
        name = f".{short}-{digest}.partial"
    return out.parent / name


#: folders this process holds locked: (device, inode) -> [fd, holders]
_HELD: dict[tuple[int, int], list[int]] = {}
_HELD_LOCK = threading.Lock()


class FolderLock:
    """An exclusive lock on a folder (created if missing), re-entrant within a process.

    ``flock`` on the folder itself: it dies with the process that holds it, so a killed
    run never blocks the next. A folder that is a symbolic link is refused, never
    followed. With ``remove_if_empty``, releasing removes the folder when it is empty.

    >>> import tempfile, pathlib
    >>> d = pathlib.Path(tempfile.mkdtemp()) / "work"
    >>> with FolderLock(d, remove_if_empty=True):
    ...     d.is_dir()
    True
    >>> d.exists()
    False
    """

    def __init__(self, path: str | Path, *, remove_if_empty: bool = False) -> None:
        self.path = Path(path)
        self.remove_if_empty = remove_if_empty
        self.key: tuple[int, int] | None = None
        self.made: list[Path] = []  # parent folders made for it, removed with it

    def __enter__(self) -> FolderLock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()

    def _refuse_link(self) -> None:
        try:
            link = stat.S_ISLNK(os.lstat(self.path).st_mode)
        except (FileNotFoundError, NotADirectoryError):
            link = False
        except OSError as e:  # a name too long, a folder we may not look into: one line
            raise write_error(self.path, e) from None
        if link:
            raise SymspecInputError(f"{self.path} is a symbolic link; refusing to follow it (remove it if it is not yours)")

    def acquire(self) -> FolderLock:
        try:
            return self._acquire()
        except BaseException:
            for folder in reversed(self.made):
                with contextlib.suppress(OSError):
                    folder.rmdir()
            raise

    def _acquire(self) -> FolderLock:
        for _ in range(10):
            self._refuse_link()
            try:
                self.made += _make_parents(self.path.parent)
                self.path.mkdir(exist_ok=True)
                fd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
            except FileNotFoundError:
                continue  # removed between mkdir and open: try again
            except OSError as e:
                self._refuse_link()
                if e.errno in (errno.ENOTDIR, errno.EEXIST):
                    raise SymspecInputError(f"{self.path} exists and is not a folder") from None
                raise write_error(self.path, e) from None
            st = os.fstat(fd)
            key = (st.st_dev, st.st_ino)
            with _HELD_LOCK:
                if key in _HELD:
                    os.close(fd)
                    _HELD[key][1] += 1
                    self.key = key
                    return self
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                raise SymspecInputError(f"another run is using {self.path}; wait for it to finish, or write "
                                        "another output") from None
            except OSError as e:
                if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
                    os.close(fd)
                    raise write_error(self.path, e) from None
                # a file system without locks: go on unlocked rather than refuse to work
            # the run that held the lock may have removed the folder and another made a
            # new one: only the folder now at the path counts
            try:
                now = os.stat(self.path, follow_symlinks=False)
                same = stat.S_ISDIR(now.st_mode) and (now.st_dev, now.st_ino) == key
            except FileNotFoundError:
                same = False
            if not same:
                os.close(fd)
                continue
            with _HELD_LOCK:
                _HELD[key] = [fd, 1]
            self.key = key
            return self
        raise SymspecInputError(f"cannot lock {self.path}: it keeps being removed and made again")

    def release(self) -> None:
        key, self.key = self.key, None
        if key is None:
            return
        with _HELD_LOCK:
            entry = _HELD[key]
            entry[1] -= 1
            if entry[1] > 0:
                return
            del _HELD[key]
        try:
            if self.remove_if_empty:
                with contextlib.suppress(OSError):
                    now = os.stat(self.path, follow_symlinks=False)
                    if (now.st_dev, now.st_ino) == key:
                        self.path.rmdir()  # fails when not empty: the folder stays
                for folder in reversed(self.made):
                    with contextlib.suppress(OSError):
                        folder.rmdir()
        finally:
            os.close(entry[0])  # closing the descriptor releases the flock


def clear_folder(path: str | Path) -> None:
    """Remove what ``path`` holds but keep the folder (and so a lock held on it). Raises
    ``OSError`` when something cannot be removed: a half-cleared folder must not be
    taken for an empty one."""
    for entry in Path(path).iterdir():
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink(missing_ok=True)


__all__ = [
    "MARKER",
    "STAGING_PREFIX",
    "TMP_PREFIX",
    "FolderLock",
    "Target",
    "atomic_write",
    "atomic_write_bytes",
    "atomic_write_text",
    "check_outputs",
    "check_overlap",
    "clear_folder",
    "deferred_interrupts",
    "existing_inputs",
    "file_mode",
    "folder_mode",
    "is_write_error",
    "new_staging",
    "normal_permissions",
    "publish",
    "publish_bytes",
    "stale_staging",
    "terminate_as_exit",
    "umask",
    "work_folder",
    "write_error",
]
