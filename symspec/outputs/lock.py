"""Work folders: a resumable run's folder next to its output, locked with ``flock`` while a
run uses it (:class:`FolderLock`), and cleared without losing the lock."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import os
import shutil
import stat
import threading
from pathlib import Path

from ..errors import SymspecInputError
from .base import NAME_MAX, make_parents, write_error


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
                self.made += make_parents(self.path.parent)
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
