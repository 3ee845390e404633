"""Helpers shared by the commands: error mapping, output, spec resolution."""

from __future__ import annotations

import contextlib
import functools
import json
import sys
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import click

F = TypeVar("F", bound=Callable[..., Any])

EXIT_OK, EXIT_FAIL, EXIT_INPUT = 0, 1, 2


class FiniteFloat(click.FloatRange):
    """A ``click.FloatRange`` that also refuses ``nan`` and ``inf``: click parses both,
    and nan passes any range (it compares false with every bound), so ``--alpha nan``
    once wrote a model whose every weight was NaN."""

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        import math

        rv = click.FLOAT.convert(value, param, ctx)
        if not math.isfinite(rv):
            self.fail(f"{value!r} is not a finite number", param, ctx)
        return super().convert(rv, param, ctx)


class LrScale(click.ParamType):
    """``KIND=X[,KIND=X...]``: learned matching's per-kind learning-rate factors
    (:attr:`symspec.learned.LearnedOptions.lr_scale`), e.g. ``orthogonal=3,linear=0.3``."""

    name = "lr-scale"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        import math

        if isinstance(value, tuple):
            return value
        from symspec.learned.method import LR_KINDS  # light: no torch

        out: dict[str, float] = {}
        for part in str(value).split(","):
            kind, eq, factor = part.strip().partition("=")
            kind = kind.strip()
            if not eq or not kind:
                self.fail(f"{part.strip()!r} is not KIND=FACTOR (kinds: {', '.join(LR_KINDS)})", param, ctx)
            if kind not in LR_KINDS:
                self.fail(f"unknown kind {kind!r}; kinds: {', '.join(LR_KINDS)}", param, ctx)
            if kind in out:
                self.fail(f"{kind} is given twice", param, ctx)
            try:
                x = float(factor)
            except ValueError:
                x = math.nan
            if not (x > 0 and math.isfinite(x)):
                self.fail(f"the factor of {kind} must be a positive number, got {factor.strip()!r}", param, ctx)
            out[kind] = x
        return tuple(out.items())


class MethodChoice(click.ParamType):
    """An alignment method: any name in the registry (:mod:`symspec.alignment`), read when
    the command runs, so that a method registered by a plugin or a test is offered with
    no change here. Never a second hard-coded list of methods."""

    name = "method"

    def get_metavar(self, param: click.Parameter, ctx: click.Context | None = None) -> str:
        from symspec.alignment import method_names

        return "|".join(method_names())

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        from symspec.alignment import get_method
        from symspec.errors import SymspecInputError

        try:
            return get_method(str(value)).name
        except SymspecInputError as e:
            self.fail(str(e), param, ctx)


EXIT_INTERRUPTED = 130  # 128 + SIGINT, what shells report for Ctrl-C


class _HeldWhileLoading:
    """A module loader that runs the real one with Ctrl-C held (see :class:`_WholeImports`)."""

    def __init__(self, loader: Any) -> None:
        self._loader = loader

    def create_module(self, spec: Any) -> Any:
        from symspec.outputs import deferred_interrupts

        with deferred_interrupts():
            return self._loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        from symspec.outputs import deferred_interrupts

        with deferred_interrupts():
            self._loader.exec_module(module)

    def __getattr__(self, name: str) -> Any:  # resources, source, ...: the real loader's
        return getattr(self._loader, name)


class _WholeImports:
    """An import finder that has torch and numpy imported whole, Ctrl-C held until they are
    in (a second or so). Their C start-up cannot take an interrupt: torch imports numpy
    from C and goes on without it on ANY error (a Ctrl-C there was swallowed, numpy left
    half-imported, and the run failed far away: ``numpy._core has no attribute
    _multiarray_umath``), and a KeyboardInterrupt inside pybind11's start-up aborts the
    process (``terminate called after throwing ... error_already_set``, exit -6)."""

    WHOLE = ("torch", "numpy")

    def __init__(self) -> None:
        self._finding = False

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name not in self.WHOLE or self._finding:
            return None
        import importlib.machinery

        self._finding = True
        try:
            spec = importlib.machinery.PathFinder.find_spec(name, path, target)
        finally:
            self._finding = False
        if spec is not None and spec.loader is not None:
            spec.loader = _HeldWhileLoading(spec.loader)
        return spec


@contextlib.contextmanager
def _watching_interrupts() -> Iterator[list[int]]:
    """Ctrl-C as ``KeyboardInterrupt``, as always, but remembered: a library that swallows
    it (a broad ``except``, a C extension that clears every error) cannot turn it into
    another failure's traceback. Also puts :class:`_WholeImports` first in line."""
    import os
    import signal
    import threading

    seen: list[int] = []
    finder = _WholeImports()
    sys.meta_path.insert(0, finder)  # type: ignore[arg-type]
    ours = threading.current_thread() is threading.main_thread() and \
        signal.getsignal(signal.SIGINT) is signal.default_int_handler

    def again_soon() -> None:
        """Send the interrupt again 50 ms from now, from a timer thread."""
        timer = threading.Timer(0.05, os.kill, args=(os.getpid(), signal.SIGINT))
        timer.daemon = True
        timer.start()

    def on_sigint(signum: int, frame: Any) -> None:
        # where it runs now: ``frame`` is stale when a held interrupt is handed on (deferred_interrupts)
        if _in_library_import(sys._getframe(1)):
            # a library's module body runs (torch.export imports its parts on first use, some
            # from C++): a KeyboardInterrupt raised there can cross C++ that cannot take it
            # ('terminate called after throwing an instance of python_error', exit -6): the
            # interrupt comes again 50 ms later, until the import is done
            again_soon()
            return
        seen.append(signum)
        raise KeyboardInterrupt

    def unraisable(info: Any) -> None:
        # a KeyboardInterrupt raised where Python cannot raise (a weakref callback, such as
        # importlib's module-lock clean-up, or a __del__) is printed as "Exception ignored"
        # and lost: the run went on to exit 0. Deliver the signal again instead, a moment
        # later from a timer thread: raised now it would land in this hook, where Python
        # cannot raise either; later it is handled in ordinary code (should it land in such
        # a place again, this hook sends it once more).
        if ours and issubclass(info.exc_type, KeyboardInterrupt):
            again_soon()
        else:
            previous_hook(info)

    previous_hook = sys.unraisablehook
    if ours:
        signal.signal(signal.SIGINT, on_sigint)
        sys.unraisablehook = unraisable
    try:
        yield seen
    finally:
        if ours:
            signal.signal(signal.SIGINT, signal.default_int_handler)
            sys.unraisablehook = previous_hook
        with contextlib.suppress(ValueError):
            sys.meta_path.remove(finder)  # type: ignore[arg-type]


@functools.cache
def _library_paths() -> tuple[str, ...]:
    """Where installed libraries and the standard library live (not the user's files)."""
    import os
    import sysconfig

    paths = {sysconfig.get_paths().get(k) for k in ("purelib", "platlib", "stdlib", "platstdlib")}
    return tuple(sorted(os.path.join(p, "") for p in paths if p))


def _in_library_import(frame: Any) -> bool:
    """Is ``frame``, or a frame that called it, the body of a library module that the
    import machinery runs (the user's own files are not: their imports stay
    interruptible; nor is a library's ``__main__`` that runpy runs, pytest's say)?"""
    libs = LIBRARY_PATHS or _library_paths()
    while frame is not None:
        code, caller = frame.f_code, frame.f_back
        if (code.co_name == "<module>" and code.co_filename.startswith(libs) and caller is not None
                and caller.f_code.co_filename.startswith("<frozen importlib")):
            return True
        frame = caller
    return False


#: the folders :func:`_in_library_import` counts as libraries (empty: the interpreter's own)
LIBRARY_PATHS: tuple[str, ...] = ()


def handle_errors(fn: F) -> F:
    """Map symspec's input errors to exit code 2 with a clean message (no traceback), the
    file system's refusals that the environment caused (a full disk, a read-only file
    system, a name too long: :func:`symspec.io_util.environment_error`) too, wherever
    they surface, and Ctrl-C to the shell's convention, exit 130 with one line (outputs
    were already rolled back by the code that was writing them), also when a library
    swallowed the interrupt and something else failed because of it."""

    if getattr(fn, "_handles_errors", False):  # already wrapped (the group wraps every command)
        return fn

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        from symspec.errors import SymspecInputError

        with _watching_interrupts() as interrupted:
            try:
                return fn(*args, **kwargs)
            except KeyboardInterrupt:
                pass
            except Exception as e:
                if not interrupted:
                    from symspec.io_util import environment_error

                    message = str(e) if isinstance(e, SymspecInputError) else environment_error(e)
                    if message is None:
                        raise
                    click.echo(f"error: {message}", err=True)
                    sys.exit(EXIT_INPUT)
        click.echo("interrupted", err=True)
        sys.exit(EXIT_INTERRUPTED)

    wrapper._handles_errors = True  # type: ignore[attr-defined]
    return wrapper  # type: ignore[return-value]


def echo_json(data: Any) -> None:
    click.echo(json.dumps(data, indent=2, default=str))


def stderr_console() -> Any:
    from rich.console import Console

    return Console(stderr=True)


#: seconds between two progress lines where stderr is not a terminal (a log file, a pipe)
PROGRESS_SECONDS_ENV = "SYMSPEC_PROGRESS_SECONDS"
PROGRESS_SECONDS = 5.0


def progress_seconds() -> float:
    """:data:`PROGRESS_SECONDS`, or ``$SYMSPEC_PROGRESS_SECONDS`` when it is a number of
    seconds (0: a line for every update, as the tests use it)."""
    import math
    import os

    try:
        value = float(os.environ.get(PROGRESS_SECONDS_ENV, ""))
    except ValueError:
        return PROGRESS_SECONDS
    return value if value >= 0 and not math.isnan(value) else PROGRESS_SECONDS


def progress_bar(console: Any, what: str | None = None, *, spinner: bool = False, disable: bool = False) -> Any:
    """A rich progress bar (description, bar, done/total, elapsed time), not yet started:
    the caller enters it. On a terminal it is drawn in place and erased at the end; where
    the console is not a terminal (stderr logged to a file, a pipe, CI) the same object
    prints a plain line instead, at most one every :func:`progress_seconds`, the first
    after that long (a quick command prints none)::

        check: sample 2/3: attn (5/12), 41 s, about 95 s left

    ``what`` starts each line (default: the running command's name); ``spinner`` adds a
    spinner to the bar; ``disable`` shows nothing either way."""
    from rich import progress as rp

    columns = ([rp.SpinnerColumn()] if spinner else []) + [rp.TextColumn("{task.description}"), rp.BarColumn(),
                                                            rp.MofNCompleteColumn(), rp.TimeElapsedColumn()]
    if disable or console.is_terminal:
        return rp.Progress(*columns, console=console, transient=True, disable=disable)
    if what is None:
        ctx = click.get_current_context(silent=True)
        what = ctx.info_name if ctx is not None and ctx.info_name else "symspec"
    return _logged_progress()(*columns, console=console, transient=True, disable=True, what=what,
                              interval=progress_seconds())


@functools.cache
def _logged_progress() -> type:
    """rich's Progress, undrawn, printing a throttled plain line per update, and while a
    step runs long without one, a line every interval all the same (a timer thread): a
    log must show that a long trace or forward pass is still going. Built on first use:
    rich is imported only by commands that show progress."""
    import threading
    import time

    from rich.progress import Progress
    from rich.text import Text

    class LoggedProgress(Progress):
        def __init__(self, *columns: Any, what: str, interval: float, **kw: Any) -> None:
            super().__init__(*columns, **kw)
            self.what, self.interval = what, interval
            self.begin = self.last = time.monotonic()  # the first line after one interval: a quick run stays quiet
            #: task -> (time, done) where its current count started, its total, its last done
            self.counts: dict[Any, tuple[float, float, float, float]] = {}
            self.current: Any = None  # the task updated last: what the timer reports
            self.line_lock = threading.Lock()
            self.stopped = threading.Event()
            self.timer: threading.Thread | None = None

        def start(self) -> None:
            super().start()
            if self.interval > 0 and self.timer is None:
                self.timer = threading.Thread(target=self.tick, name="symspec-progress", daemon=True)
                self.timer.start()

        def stop(self) -> None:
            self.stopped.set()
            if self.timer is not None:
                self.timer.join()
            super().stop()

        def tick(self) -> None:
            while not self.stopped.wait(max(0.05, self.interval / 5)):
                if self.current is not None:
                    self.print_line(self.current, counted=False)

        def add_task(self, *args: Any, **kw: Any) -> Any:
            task = super().add_task(*args, **kw)
            self.print_line(task)
            return task

        def update(self, task_id: Any, **kw: Any) -> None:
            super().update(task_id, **kw)
            self.print_line(task_id)

        def advance(self, task_id: Any, advance: float = 1) -> None:
            super().advance(task_id, advance)
            self.print_line(task_id)

        def print_line(self, task_id: Any, counted: bool = True) -> None:
            with self.line_lock:
                task = self._tasks.get(task_id)
                if task is None:
                    return
                self.current = task_id
                now = time.monotonic()
                total, done = task.total, task.completed
                if total is not None and counted:  # the rate is measured over the current count, not the set-up before it
                    t0, d0, total0, last = self.counts.get(task_id, (now, done, total, done))
                    if total != total0 or done < last:  # a new count (a phase, a round) starts
                        t0, d0 = now, done
                    self.counts[task_id] = (t0, d0, total, done)
                if now - self.last < self.interval:
                    return
                self.last = now
                line = f"{self.what}: {Text.from_markup(str(task.description)).plain}"
                if total is not None:
                    line += f" ({done:.0f}/{total:.0f})"
                line += f", {now - self.begin:.0f} s"
                t0, d0, _, _ = self.counts.get(task_id, (now, done, total, done))
                if total is not None and d0 < done < total and now > t0:
                    line += f", about {max(1.0, (now - t0) / (done - d0) * (total - done)):.0f} s left"
                self.console.print(line, markup=False, highlight=False, soft_wrap=True)

    return LoggedProgress


@contextlib.contextmanager
def progress_messages(what: str, quiet: bool = False) -> Iterator[Callable[[str], None]]:
    """A progress callback for the core's messages (:class:`symspec.progress.Step`: text,
    with ``done`` of ``total`` where it can count), shown by :func:`progress_bar` on
    stderr while the block runs; ``quiet`` shows nothing."""
    bar = progress_bar(stderr_console(), what, spinner=True, disable=quiet)
    with bar:
        task = bar.add_task("starting", total=None)

        def say(message: str) -> None:
            done, total = getattr(message, "done", None), getattr(message, "total", None)
            if total is None:  # a step that does not count: no count left over from the one before
                for t in bar.tasks:
                    if t.id == task:
                        t.total, t.completed = None, 0
            bar.update(task, description=str(message), **({"completed": done, "total": total} if total is not None else {}))

        yield say


def stdout_console() -> Any:
    from rich.console import Console

    console = Console()
    if not console.is_terminal:  # pipes and CI logs: do not squeeze tables to 80 columns
        console = Console(width=140)
    return console


def resolve_spec(spec_arg: str | None, model: Any, hint: str | None = None, model_args: str | None = None) -> Any:
    """--spec, else the model file's SPEC, else the built-in spec for the model's class
    (where several list it, the one that binds the model).
    ``model_args``: the model as the user named it (shell-quoted), for the suggestion to
    draft a spec with ``symspec infer``."""
    from symspec.errors import SymspecInputError
    from symspec.spec import builtin_names, load_spec, specs_for_class

    if spec_arg:
        return load_spec(spec_arg)
    if hint:
        return load_spec(hint)
    cls = type(model).__name__
    found = specs_for_class(cls)
    if not found:
        raise SymspecInputError(f"no built-in spec fits {cls} (built-in specs: {', '.join(builtin_names())}); pass --spec PATH, "
                                f"or draft one with: symspec infer {model_args or 'MODEL'} --out spec.yaml")
    if len(found) > 1:  # one class, several layouts (T5 and T5 v1.1): the one that binds this model
        fitting = [n for n in found if _binds(load_spec(n), model)]
        if len(fitting) == 1:
            return load_spec(fitting[0])
        why = "" if fitting else " (none binds this model as it is: --spec NAME says why)"
        raise SymspecInputError(f"several built-in specs fit {cls}: {', '.join(fitting or found)}; choose one with "
                                f"--spec{why}")
    return load_spec(found[0])


def _binds(spec: Any, model: Any) -> bool:
    from symspec.binding import bind
    from symspec.errors import DiagnosticsError

    try:
        bind(spec, model)
    except DiagnosticsError:  # a parameter, a tie or a dimension of another layout
        return False
    return True


def data_inputs(data_arg: str | None) -> list[str]:
    """The files or folders a ``--data`` source reads (for the output checks: no output
    may overwrite them). A source that does not parse names none here; loading it
    reports the error in its own words."""
    if not data_arg:
        return []
    from symspec.data import parse_source
    from symspec.errors import SymspecInputError

    try:
        src = parse_source(data_arg)
    except SymspecInputError:
        return []
    return src.paths()


def config_warning(a: Any, b: Any, names: tuple[str, str], mixing: str) -> str | None:
    """The warning line for two loaded models whose configs differ in a field that changes
    the function (same weight shapes do not make the same model); None when they agree.
    ``mixing`` names what mixes them: ``"interpolation"``, ``"average"``."""
    from symspec.loading import config_differences

    diff = config_differences(a, b)
    if not diff:
        return None
    shapes_a = {k: tuple(v.shape) for k, v in a.model.state_dict().items()}
    if shapes_a != {k: tuple(v.shape) for k, v in b.model.state_dict().items()}:
        # different widths: B is lifted into A's shape first (nothing of two configs mixes),
        # or the command refuses the pair itself; either way not "same weight shapes"
        return None
    fields = "; ".join(f"{k}: {va!r} vs {vb!r}" for k, (va, vb) in diff.items())
    return (f"warning: {names[0]} and {names[1]} have different configs ({fields}): same weight shapes, "
            f"but not the same function; their {mixing} mixes two models")


def auto_options(method: Any, candidates: str | None, budget: float | None) -> Any:
    """``--candidates`` and ``--budget`` as :class:`~symspec.alignment.AutoOptions` (None
    when neither is given); refused (one line, exit 2) for a method other than auto."""
    if candidates is None and budget is None:
        return None
    from symspec.alignment import AutoOptions
    from symspec.errors import SymspecInputError

    if method.name != "auto":
        names = ", ".join(f for f, v in (("--candidates", candidates), ("--budget", budget)) if v is not None)
        raise SymspecInputError(f"{names}: for --method auto (the default with --data), not '{method.name}'")
    names = tuple(n.strip() for n in candidates.split(",") if n.strip()) if candidates is not None else None
    return AutoOptions(candidates=names, budget=budget)


def learned_options(method: Any, flags: dict[str, tuple[str, Any]]) -> Any:
    """The learned-matching flags given (field of
    :class:`~symspec.learned.LearnedOptions` -> (flag, value or None)) as LearnedOptions,
    with the method's own default permutations; None when none is given. Refused (one
    line, exit 2) for a method that is not learned matching, and for --steps with
    --epochs."""
    given = {field: (flag, value) for field, (flag, value) in flags.items() if value is not None}
    if not given:
        return None
    from symspec.errors import SymspecInputError
    from symspec.learned import LearnedOptions
    from symspec.learned.method import LearnedMatching

    if not isinstance(method, LearnedMatching):
        names = ", ".join(flag for flag, _ in given.values())
        raise SymspecInputError(f"{names}: for --method learned (or learned-perm), not '{method.name}'")
    if "steps" in given and "epochs" in given:
        raise SymspecInputError("--steps and --epochs: give one of them")
    return LearnedOptions(**{"permutations": method.permutations, **{f: v for f, (_, v) in given.items()}})


def default_method(method: str | None, data_arg: str | None) -> str:
    """--method as given; unset, weight matching, or with --data the data-driven default
    (:data:`symspec.alignment.DATA_DEFAULT`: auto, which tries the closed-form methods and
    keeps the best) -- for match, merge and universe alike."""
    if method is not None:
        return method
    from symspec.alignment import DATA_DEFAULT

    return DATA_DEFAULT if data_arg is not None else "weight"
