"""The ``symspec`` command: a thin, lazy shell over the library.

Commands are imported only when run, so ``symspec --help`` imports neither torch
nor cvxpy nor matplotlib. Exit codes: 0 success, 1 a check that failed, 2 bad input.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import signal
import sys
from typing import Any, NoReturn


def _interrupted(*_: Any) -> NoReturn:
    """Ctrl-C outside a command's own handling (its modules loading, the command line
    parsed): what handle_errors says, exit 130 and one line, no traceback."""
    print("interrupted", file=sys.stderr)
    raise SystemExit(130)


#: this process is the ``symspec`` command itself, not a program that imports this module
_AS_COMMAND = os.path.basename(getattr(sys.modules.get("__main__"), "__file__", None) or "") == "symspec"

# Ctrl-C while the modules below load (a fraction of a second, more on a busy machine) is
# an interrupt too
if _AS_COMMAND and signal.getsignal(signal.SIGINT) is signal.default_int_handler:
    signal.signal(signal.SIGINT, _interrupted)

import click  # noqa: E402

from ._common import EXIT_INTERRUPTED, handle_errors  # noqa: E402

#: command name -> (module, attribute, one-line help). New commands register here.
COMMANDS: dict[str, tuple[str, str, str]] = {
    "check": ("symspec.cli.check", "check_cmd", "Verify that a spec's symmetries preserve a model's function."),
    "validate": ("symspec.cli.spec_cmds", "validate_cmd", "Validate spec files (no model needed)."),
    "specs": ("symspec.cli.spec_cmds", "specs_cmd", "List the built-in specs."),
    "schema": ("symspec.cli.spec_cmds", "schema_cmd", "Print the JSON Schema of the spec format."),
    "barrier": ("symspec.cli.barrier", "barrier_cmd", "Loss along the line between two models, and its barrier."),
    "universe": ("symspec.cli.universe", "universe_cmd", "Align many models into one universe and merge them."),
    "match": ("symspec.cli.match", "match_cmd", "Align model B to model A (weight matching by default); write B aligned."),
    "methods": ("symspec.cli.methods", "methods_cmd", "List the registered alignment methods."),
    "merge": ("symspec.cli.match", "merge_cmd", "Write the interpolation of A and B, aligned first."),
    "infer": ("symspec.cli.infer", "infer_cmd", "Draft a checked spec from a model's traced graph."),
}


class OneLineUsageError(click.UsageError):
    """A usage error (a bad option value, a missing argument) shown as every other input
    error is: one ``error: ...`` line on stderr and exit code 2, pointing to --help
    instead of printing the usage block."""

    def show(self, file: Any = None) -> None:
        where = f" (see '{self.ctx.command_path} --help')" if self.ctx is not None else ""
        message = "; ".join(line.strip() for line in self.format_message().splitlines() if line.strip())
        click.echo(f"error: {message}{where}", file=file, err=file is None)


#: usage errors whose message is the help text (bare ``symspec``): shown as click shows them
_SHOWS_HELP: tuple[type[Exception], ...] = tuple(
    t for t in (getattr(click.exceptions, "NoArgsIsHelpError", None),) if t is not None)


class LazyGroup(click.Group):
    def make_context(self, info_name: str | None, args: list[str], parent: click.Context | None = None, **extra: Any) -> click.Context:
        try:
            return super().make_context(info_name, args, parent, **extra)
        except (OneLineUsageError, *_SHOWS_HELP):
            raise
        except click.UsageError as e:  # the group's own options: symspec --bogus
            raise OneLineUsageError(e.format_message(), e.ctx) from e
        except KeyboardInterrupt:
            _interrupted()

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except (OneLineUsageError, *_SHOWS_HELP):
            raise
        except click.UsageError as e:  # a command's options and arguments, an unknown command
            raise OneLineUsageError(e.format_message(), e.ctx) from e
        except KeyboardInterrupt:  # Ctrl-C while the command's modules load (its handle_errors is not on yet)
            _interrupted()

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(COMMANDS)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        entry = COMMANDS.get(cmd_name)
        if entry is None:
            return None
        module, attr, _ = entry
        command: click.Command = getattr(importlib.import_module(module), attr)
        if command.callback is not None:  # every command maps errors and Ctrl-C alike, decorated or not
            command.callback = handle_errors(command.callback)
        return command

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        rows = [(name, COMMANDS[name][2]) for name in self.list_commands(ctx)]
        with formatter.section("Commands"):
            formatter.write_dl(rows)


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="symspec", prog_name="symspec")
def cli() -> None:
    """symspec: weight-space symmetries of Transformers.

    Write a spec (YAML) for an architecture, check it against a model, and use it to
    align and merge checkpoints. Exit codes: 0 ok, 1 a check failed, 2 bad input.
    """


def _exit_interrupted() -> NoReturn:
    """End an interrupted command without finalising the interpreter: its outputs are
    rolled back and its line printed, and a thread still running (a library's worker, a
    user's model code) that enters the interpreter while it shuts down aborts the process
    (``Fatal Python error: PyThreadState_Get``, exit -6 instead of 130: CPython gh-87135,
    seen once in CI at a Ctrl-C 4 s into ``barrier --plot``). Nothing is left to run at
    exit: the streams are flushed here."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):  # a closed or broken stream: the exit code is what is left to give
            stream.flush()
    os._exit(EXIT_INTERRUPTED)


def main(argv: list[str] | None = None) -> Any:
    if signal.getsignal(signal.SIGINT) is _interrupted:  # started: Ctrl-C unwinds (rolls back) from here on
        signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        return cli.main(args=argv, prog_name="symspec", standalone_mode=True)
    except SystemExit as e:
        if _AS_COMMAND and e.code == EXIT_INTERRUPTED:
            _exit_interrupted()
        raise
    finally:  # the command is over (outputs published or rolled back): a Ctrl-C while the
        # interpreter shuts down has nothing left to stop, and would only hide the exit code
        signal.signal(signal.SIGINT, signal.SIG_IGN)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
