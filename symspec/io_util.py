"""JSON documents keep non-finite numbers as strings (files themselves are written by
:mod:`symspec.outputs`: :func:`~symspec.outputs.atomic_write` and the rest); small input
files (specs, lists, configs) are read whole, but only when they are regular files of a
sane size (:func:`read_small_file`); and the file system's refusals that are the
environment's, never the program's, as one line (:func:`environment_error`)."""

from __future__ import annotations

import errno
import math
import os
import stat
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from .errors import SymspecInputError


def json_safe(x: Any) -> Any:
    """``x`` with every non-finite float as the string "nan", "inf" or "-inf" (strict
    JSON has no such numbers), mappings and sequences walked, tuples as lists.

    >>> json_safe({"a": [1.0, float("inf")], "b": (float("nan"),)})
    {'a': [1.0, 'inf'], 'b': ['nan']}
    """
    if isinstance(x, float) and not math.isfinite(x):
        return "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")
    if isinstance(x, Mapping):
        return {k: json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [json_safe(v) for v in x]
    return x


#: the most a text input read whole may hold (a spec with 100,000 parameters is 6 MiB)
MAX_TEXT_BYTES = 64 * 2**20

_KINDS = ((stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"), (stat.S_ISFIFO, "a pipe (FIFO)"),
          (stat.S_ISSOCK, "a socket"))


def _not_a_regular_file(path: str | Path, mode: int, what: str) -> str | None:
    """Why ``path`` (of file ``mode``) cannot be read as a ``what``; None for a regular file."""
    if stat.S_ISDIR(mode):
        return f"{path}: is a folder, not a {what}"
    if not stat.S_ISREG(mode):
        kind = next((name for test, name in _KINDS if test(mode)), "something other than a regular file")
        return f"{path}: is {kind}, not a {what} (a regular file)"
    return None


def refuse_special_file(path: str | Path, what: str, error: Callable[[str], Exception]) -> None:
    """Refuse a device, a pipe or a socket at ``path`` before anything opens it (a reader
    that is not :func:`read_small_file`: ``torch.load`` of a FIFO waits for a writer
    forever, of ``/dev/zero`` until memory runs out), with :func:`read_small_file`'s words."""
    refusal = _not_a_regular_file(path, os.stat(path).st_mode, what)
    if refusal:
        raise error(refusal)


def read_small_file(path: str | Path, what: str, *, limit: int | None = None,
                    error: Callable[[str], Exception] | None = None) -> bytes:
    """The bytes of ``path``, a regular file of at most ``limit`` bytes; anything else is
    refused as ``error(message)`` (default :class:`~symspec.errors.SymspecInputError`),
    one line that names the file and says what ``what`` (``"spec file"``) should be.
    ``limit`` defaults to :data:`MAX_TEXT_BYTES`.

    A device or a pipe is refused before a byte is read: ``/dev/zero`` never ends (it
    was read until memory ran out), and opening a FIFO waits for a writer (opened
    non-blocking here). At most ``limit + 1`` bytes are read, whatever the size says.

    >>> read_small_file("/dev/zero", "spec file")
    Traceback (most recent call last):
    ...
    symspec.errors.SymspecInputError: /dev/zero: is a character device, not a spec file (a regular file)
    """
    fail = error or SymspecInputError
    limit = MAX_TEXT_BYTES if limit is None else limit
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise fail(f"{path}: no such {what}") from None
    except OSError as e:
        raise fail(f"{path}: cannot read the {what} ({e.strerror or e})") from None
    try:
        refusal = _not_a_regular_file(path, os.fstat(fd).st_mode, what)
        if refusal:
            raise fail(refusal)
        chunks, size = [], 0
        while size <= limit:  # a regular file may still grow while it is read
            chunk = os.read(fd, min(limit + 1 - size, 2**20))
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
    except OSError as e:
        raise fail(f"{path}: cannot read the {what} ({e.strerror or e})") from None
    finally:
        os.close(fd)
    data = b"".join(chunks)
    if len(data) > limit:
        most = f"{limit / 2**20:g} MiB" if limit >= 2**20 else f"{limit:,} bytes"
        raise fail(f"{path}: larger than {most}, more than a {what} holds; is it the right file?")
    return data


#: what the file system says about the place, not about the program: a full disk, a
#: read-only file system, a name too long, no permission, a loop of links; each with what
#: to do about it. (A missing file, or a folder where a file was expected, is the loaders'
#: to say in their own words: here it could as well be a bug.)
_ENVIRONMENT = {
    errno.ENOSPC: "free some space and run it again",
    errno.EDQUOT: "free some space (or raise the quota) and run it again",
    errno.EFBIG: "write it to another file system",
    errno.EROFS: "write it to another file system",
    errno.ENAMETOOLONG: "use a shorter path",
    errno.EACCES: "check its permissions",
    errno.EPERM: "check its permissions",
    errno.ELOOP: "a symbolic link points, through others, back to itself",
    errno.EIO: "the device failed: check it",
    errno.EMFILE: "too many open files: raise the limit (ulimit -n)",
    errno.ENFILE: "too many open files in the system",
}


def environment_error(e: BaseException) -> str | None:
    """One line for an ``OSError`` that the place caused (:data:`_ENVIRONMENT`): the path,
    the system's reason and what to do; None for any other error (a bug shows as one).

    >>> environment_error(OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "out/x.json"))
    'out/x.json: No space left on device; free some space and run it again'
    >>> environment_error(OSError(errno.ENOENT, "No such file or directory", "x")) is None
    True
    """
    if not isinstance(e, OSError) or e.errno not in _ENVIRONMENT:
        return None
    reason = e.strerror or os.strerror(e.errno)
    where = f"{os.fsdecode(e.filename)}: " if e.filename is not None else ""
    return f"{where}{reason}; {_ENVIRONMENT[e.errno]}"


__all__ = ["MAX_TEXT_BYTES", "environment_error", "json_safe", "read_small_file"]
