"""Executors on this machine: :class:`InlineExecutor` (this process) and
:class:`ProcessExecutor` (``jobs`` worker processes, each running one task at a time).

Workers are started as ``python -c`` (not multiprocessing's spawn), so a user's script
needs no ``if __name__ == "__main__"`` guard and is never re-imported in the workers;
what the parent registered at run time reaches them only through the ``setup`` hook
(``module:function``) or installed entry points.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from contextlib import suppress
from multiprocessing.connection import Connection, wait
from typing import Any

import attrs

from .task import Result, Task, failure, run_task

OnDone = Callable[[Task, Result], None]


def describe_exit(code: int | None) -> str:
    """A worker's exit status in words (``killed by SIGKILL (out of memory?)``)."""
    if code is None:
        return "no exit status"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        hint = " (out of memory?)" if -code == signal.SIGKILL else ""
        return f"killed by {name}{hint}"
    return f"exit code {code}"


def crashed(task: Task, why: str) -> Result:
    """The result of a task whose worker died while running it."""
    return failure(task, f"the worker process died while working on it ({why})", input=False, crashed=True)


class InlineExecutor:
    """Runs the tasks one after the other in this process (a method or group registered
    here is known to them)."""

    name = "inline"
    jobs = 1

    def __init__(self, setup: str | None = None) -> None:
        self.setup = setup
        self.max_in_flight = 0

    def run(self, tasks: list[Task], on_done: OnDone) -> None:
        for t in tasks:
            self.max_in_flight = max(self.max_in_flight, 1)
            on_done(t, run_task(t, self.setup))

    def close(self) -> None:
        pass


#: seconds between a worker's checks that its parent is still alive
PARENT_POLL = 0.5


class _ParentGone(SystemExit):
    """The parent died (killed, say): the worker stops at once, quietly (``finally``
    clauses run, so a half-written file is removed)."""


def _watch_parent(parent: int) -> None:
    """Stop this worker when its parent is gone (it is then adopted by another
    process): a task's result would have nowhere to go. A thread polls; SIGTERM makes
    the main thread unwind, even inside a long task."""
    def stop(signum: int, frame: object) -> None:
        if os.getppid() == parent:  # SIGTERM from someone else: die of it, as before
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)
        raise _ParentGone(0)

    signal.signal(signal.SIGTERM, stop)

    def poll() -> None:
        while os.getppid() == parent:
            time.sleep(PARENT_POLL)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=poll, name="symspec-parent-watch", daemon=True).start()


def serve(read_fd: int, write_fd: int, parent: int | None = None) -> None:
    """A worker process's loop: run the tasks read from ``read_fd`` until told to stop,
    or until the parent (pid ``parent``) or its pipes are gone: then it exits quietly,
    never with a traceback. The first message carries the parent's ``sys.path`` and the
    setup hook."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent handles Ctrl-C and stops us
    if parent is not None:
        _watch_parent(parent)
    with suppress(_ParentGone, BrokenPipeError, EOFError, ConnectionError):
        _serve(read_fd, write_fd)
    # the parent's stderr may be a closed pipe: nothing may be left to print at exit
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            with suppress(OSError):
                os.dup2(os.open(os.devnull, os.O_WRONLY), stream.fileno())


def _serve(read_fd: int, write_fd: int) -> None:
    rx = Connection(read_fd, writable=False)
    tx = Connection(write_fd, readable=False)
    try:
        hello = rx.recv()
    except (EOFError, OSError):
        return
    sys.path[:0] = [p for p in hello["sys_path"] if p not in sys.path]
    setup = hello.get("setup")
    while True:
        try:
            task = rx.recv()
        except (EOFError, OSError):
            return
        if task is None:
            return
        result = run_task(task, setup)
        try:
            tx.send(result)
        except OSError:  # the parent is gone (a broken pipe): nobody wants the result
            return


@attrs.define(eq=False)
class _Worker:
    process: Any  # subprocess.Popen
    rx: Any  # Connection: results from the worker
    tx: Any  # Connection: tasks to the worker


class ProcessExecutor:
    """``jobs`` worker processes, each running one task at a time.

    Each worker has its own pipes, so a worker that dies (killed for memory, a segfault)
    is known by the task it held: that task fails with the exit status, the worker is
    replaced, and the other tasks carry on. Workers are reused across calls to
    :meth:`run`; their standard output goes to standard error (``--json`` output stays
    clean).
    """

    name = "processes"

    def __init__(self, jobs: int, setup: str | None = None) -> None:
        self.jobs = max(1, int(jobs))
        self.setup = setup
        self.idle: list[_Worker] = []
        self.max_in_flight = 0

    def _start(self) -> _Worker:
        task_r, task_w = os.pipe()
        res_r, res_w = os.pipe()
        code = f"from symspec.runtime.local import serve; serve({task_r}, {res_w}, {os.getpid()})"
        try:
            proc = subprocess.Popen([sys.executable, "-c", code], pass_fds=(task_r, res_w), stdin=subprocess.DEVNULL,
                                    stdout=2, close_fds=True)
        finally:
            os.close(task_r)
            os.close(res_w)
        w = _Worker(proc, Connection(res_r, writable=False), Connection(task_w, readable=False))
        w.tx.send({"sys_path": list(sys.path), "setup": self.setup})
        return w

    def _hand_out(self, pending: deque[Task], busy: dict[_Worker, Task]) -> None:
        """Give pending tasks to idle (or new) workers, up to ``jobs`` busy."""
        while pending and len(busy) < self.jobs:
            w = self.idle.pop() if self.idle else self._start()
            task = pending.popleft()
            try:
                w.tx.send(task)
            except OSError:  # it died while idle: start another
                self._drop(w)
                pending.appendleft(task)
                continue
            busy[w] = task
            self.max_in_flight = max(self.max_in_flight, len(busy))

    def _collect(self, w: _Worker, task: Task) -> Result:
        """The result of ``task`` from ``w``, or its crash (the worker is then dropped)."""
        try:
            result = w.rx.recv()
        except (EOFError, OSError):
            result = None
        if result is None:
            with suppress(Exception):
                w.process.wait(timeout=10)
            why = describe_exit(w.process.returncode)
            self._drop(w)
            return crashed(task, why)
        self.idle.append(w)
        return result

    def run(self, tasks: list[Task], on_done: OnDone) -> None:
        pending = deque(tasks)
        busy: dict[_Worker, Task] = {}
        try:
            while pending or busy:
                self._hand_out(pending, busy)
                ready = set(wait([w.rx for w in busy]))
                for w in [w for w in busy if w.rx in ready]:
                    task = busy.pop(w)
                    on_done(task, self._collect(w, task))
        except BaseException:
            for w in busy:
                self._drop(w)
            raise

    def _drop(self, w: _Worker) -> None:
        for c in (w.rx, w.tx):
            with suppress(OSError):
                c.close()
        if w.process.poll() is None:
            w.process.kill()
        with suppress(Exception):
            w.process.wait(timeout=10)

    def close(self) -> None:
        for w in self.idle:
            with suppress(OSError):
                w.tx.send(None)
        for w in self.idle:
            with suppress(Exception):
                w.process.wait(timeout=10)
            self._drop(w)
        self.idle.clear()


__all__ = ["InlineExecutor", "ProcessExecutor", "crashed", "describe_exit", "serve"]
