"""Running a user's code (a model file's import, ``build()``, ``example_inputs()``, a data
hook) so that it can neither end the command nor move it, and saying in one line where it
failed."""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import os
import sys
import threading
import traceback
from pathlib import Path
from types import ModuleType
from typing import Any

from ..errors import ModelLoadError
from ..io_util import read_small_file


class ExitCalled(SystemExit):
    """``os._exit(code)`` called by a user's code while :func:`user_code` guards it: a
    SystemExit (so that ``except Exception`` in that code does not swallow it, and every
    place that turns ``sys.exit`` into a located error does the same with it)."""


#: the guard of os._exit: how many user_code blocks run now (in any thread), the os._exit
#: they replaced and the process that replaced it (a forked child exits for real)
_guard_lock = threading.Lock()
_guard: dict[str, Any] = {"depth": 0, "exit": None, "pid": None}


def _refused_exit(code: int = 0) -> None:
    if os.getpid() != _guard["pid"]:
        _guard["exit"](code)
    raise ExitCalled(code)


@contextlib.contextmanager
def user_code(origin: str | Path, what: str) -> Any:
    """Run a user's code (a model file's import, ``build()``, ``example_inputs()``, a data
    hook) so that it cannot end the command or move it:

    - ``os._exit(code)`` raises :class:`ExitCalled` instead of ending the process with
      that code and no output (0 would read as success); the caller reports it like
      ``sys.exit``. A forked child (a data loader's worker) still exits for real, and a C
      extension that calls ``_exit`` itself is out of reach.
    - the working directory is restored afterwards when the code changed it (relative
      output paths mean the user's folder), with a ``note:`` on stderr naming ``origin``
      and ``what`` it was running.
    """
    try:
        cwd: str | None = os.getcwd()
    except OSError:  # the folder was deleted under us: nothing to restore
        cwd = None
    # one replacement for nested and concurrent blocks, put back by the last one to end
    with _guard_lock:
        if _guard["depth"] == 0:
            _guard.update(exit=os._exit, pid=os.getpid())
            os._exit = _refused_exit  # type: ignore[assignment]
        _guard["depth"] += 1
    try:
        yield
    finally:
        with _guard_lock:
            _guard["depth"] -= 1
            if _guard["depth"] == 0:
                os._exit = _guard["exit"]
        if cwd is not None:
            try:
                now: str | None = os.getcwd()
            except OSError:
                now = None
            if now != cwd:
                os.chdir(cwd)
                moved = f"to {now}" if now is not None else "to a folder that no longer exists"
                sys.stderr.write(f"note: {origin} changed the working directory {moved} ({what}); changed back to "
                                 f"{cwd}, where relative paths are read and written\n")


def describe_failure(e: BaseException) -> str:
    """One line for an exception raised by a user's code: its type and first line, or
    the exit code it asked for."""
    if isinstance(e, ExitCalled):
        return f"it called os._exit({e.code!r})"
    if isinstance(e, SystemExit):
        return f"it called sys.exit({'' if e.code is None else repr(e.code)})"
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0][:300]}" if lines else type(e).__name__


def where_in(e: BaseException, path: str | Path) -> str:
    """``path:LINE`` of the innermost frame of ``e``'s traceback in the file ``path``
    (where the user's code failed), else ``path``."""
    try:
        target = os.path.realpath(path)
        frames = traceback.extract_tb(e.__traceback__)
        line = next((f.lineno for f in reversed(frames) if os.path.realpath(f.filename) == target), None)
    except (OSError, ValueError):
        line = None
    return f"{path}:{line}" if line else str(path)


def import_file(path: str | Path) -> ModuleType:
    """Import a Python file as a fresh module (its folder is importable meanwhile)."""
    p = Path(path)
    if not p.exists():
        raise ModelLoadError(f"{path}: no such file")
    if p.is_dir() or p.suffix != ".py":
        raise ModelLoadError(f"{path}: expected a Python model file (model.py)")
    digest = hashlib.sha1(str(p.resolve()).encode()).hexdigest()[:10]
    name = f"symspec_model_{p.stem}_{digest}"
    if name in sys.modules:
        return sys.modules[name]
    # a FIFO waits for a writer, /dev/zero (or a link to it) never ends: refuse either
    # before the import system reads it
    read_small_file(p, "model file", error=ModelLoadError)
    spec = importlib.util.spec_from_file_location(name, p)
    if spec is None or spec.loader is None:
        raise ModelLoadError(f"{path}: cannot be imported")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    parent = str(p.resolve().parent)
    added = parent not in sys.path
    if added:
        sys.path.insert(0, parent)
    try:
        with user_code(p, "at import"):
            spec.loader.exec_module(module)
    except (Exception, SystemExit) as e:
        # SystemExit too: a file that calls sys.exit() must not end the command with its
        # exit code (0 would read as success)
        del sys.modules[name]
        raise ModelLoadError(f"{where_in(e, p)}: importing the model file failed: {describe_failure(e)}") from e
    finally:
        if added:
            sys.path.remove(parent)
    return module
