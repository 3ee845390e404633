"""Publishing: every output built in a staging folder next to it, then all renamed into place;
all or nothing (see :func:`publish`)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from ..errors import SymspecError, SymspecInputError
from .base import (
    MARKER,
    STAGING_PREFIX,
    Target,
    deferred_interrupts,
    file_mode,
    folder_mode,
    is_write_error,
    make_parents,
    remove_folders,
    remove_path,
    terminate_as_exit,
    write_error,
)


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
                make_parents(it.target.path.parent, made)
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
                    remove_path(it.target.path)
                if it.aside:
                    os.rename(it.previous, it.target.path)
            if it.staging is not None:
                shutil.rmtree(it.staging, ignore_errors=True)
        remove_folders(made)


def publish_bytes(targets: Sequence[tuple[Target, bytes]], *, force: bool, flag: str = "--force") -> None:
    """:func:`publish` for outputs that are bytes already."""

    def writer(data: bytes) -> Callable[[Path], None]:
        return lambda p: p.write_bytes(data)

    publish([(t, writer(data)) for t, data in targets], force=force, flag=flag)
