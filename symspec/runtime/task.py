"""What the runtime runs: a task, and running one so that it never raises.

A task is any picklable object with an ``index`` (its place among the tasks handed to an
executor), a ``name`` (how failures name it) and a ``run()`` method that returns a small
JSON-able dict. Worker processes and Ray unpickle tasks by their class's module path, so
the class must live in an importable module (not a test's ``__main__``).

>>> class Echo:
...     index, name = 0, "echo"
...     def run(self): return {"said": "hi"}
>>> run_task(Echo())
{'ok': True, 'index': 0, 'name': 'echo', 'said': 'hi'}
"""

from __future__ import annotations

import importlib
import traceback
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from ..errors import SymspecInputError
from ..process import torch_threads

#: what a task returns, and what an executor hands back: ``ok``, ``index``, ``name``,
#: then the task's own fields, or ``input``/``error`` (and ``crashed``) for a failure
Result = dict[str, Any]

_SETUP_DONE: set[str] = set()


@runtime_checkable
class Task(Protocol):
    """One unit of work for an executor."""

    index: int
    name: str

    def run(self) -> Result:
        """Do the work; raise :class:`~symspec.errors.SymspecInputError` for bad input."""
        ...


def run_setup(setup: str | None) -> None:
    """Call a ``module:function`` once per process (custom groups, alignment methods,
    logging): how worker processes learn what the parent registered at run time."""
    if not setup or setup in _SETUP_DONE:
        return
    module, _, fn = setup.partition(":")
    getattr(importlib.import_module(module), fn or "setup")()
    _SETUP_DONE.add(setup)


def failure(task: Any, error: str, *, input: bool, crashed: bool = False) -> Result:
    """The result of a task that failed: ``input`` for bad input (a model that does not
    fit), ``crashed`` when the process running it died."""
    out: Result = {"ok": False, "index": task.index, "name": task.name, "input": input}
    if crashed:
        out["crashed"] = True
    out["error"] = error
    return out


def run_task(task: Task, setup: str | None = None) -> Result:
    """Run one task after the ``setup`` hook; never raises (failures come back as
    ``{"ok": False, "error": ...}``, so that the parent decides)."""
    try:
        run_setup(setup)
        result = task.run()
    except SymspecInputError as e:
        out = failure(task, str(e), input=True)
        kind = getattr(e, "kind", None)  # e.g. "write": a failed write, reported as it is
        if isinstance(kind, str):
            out.update(kind=kind, code=getattr(e, "code", None))
        return out
    except Exception as e:  # a bug or an environment problem: report it with where it happened
        where = traceback.extract_tb(e.__traceback__)[-1]
        return failure(task, f"{type(e).__name__}: {e} (at {Path(where.filename).name}:{where.lineno})", input=False)
    return {"ok": True, "index": task.index, "name": task.name, **result}


__all__ = ["Result", "Task", "failure", "run_setup", "run_task", "torch_threads"]
