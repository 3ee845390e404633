"""One file or folder written atomically: built at a temporary sibling and renamed into place."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path

from .base import (
    TMP_PREFIX,
    deferred_interrupts,
    file_mode,
    make_parents,
    remove_folders,
    remove_path,
)


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
        make_parents(p.parent, made)
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
                    remove_path(old)
    except BaseException:
        with deferred_interrupts():
            if tmp is not None:
                remove_path(tmp)
            remove_folders(made)
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
