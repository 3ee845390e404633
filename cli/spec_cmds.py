"""``symspec validate``, ``symspec specs`` and ``symspec schema``."""

from __future__ import annotations

import sys

import click

from ._common import EXIT_INPUT, EXIT_OK, echo_json, handle_errors, stdout_console


@click.command("validate")
@click.argument("spec_files", nargs=-1, required=True, metavar="SPEC...")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
def validate_cmd(spec_files: tuple[str, ...], as_json: bool) -> None:
    """Validate spec files (or built-in names) without a model.

    Every error of every file is reported as file:line:col: key.path: message, after
    "error: " (a file with several errors: a line that counts them, then one per error).
    Exit 0 when all are valid, 2 otherwise.
    """
    from symspec.errors import DiagnosticsError, SymspecInputError
    from symspec.spec import load_spec

    results = []
    shown = []  # what stderr says of each invalid file: the error as every command prints it
    for f in spec_files:
        try:
            spec = load_spec(f)
            results.append({"file": f, "valid": True, "name": spec.name, "errors": []})
        except DiagnosticsError as e:
            results.append({"file": f, "valid": False, "errors": [str(d) for d in e.diagnostics] or [e.headline]})
            shown.append(str(e))
        except SymspecInputError as e:
            results.append({"file": f, "valid": False, "errors": [str(e)]})
            shown.append(str(e))
    if as_json:
        echo_json(results)
    else:
        for r in results:
            if r["valid"]:
                click.echo(f"{r['file']}: ok (spec '{r['name']}')")
        for text in shown:
            click.echo(f"error: {text}", err=True)
    sys.exit(EXIT_OK if all(r["valid"] for r in results) else EXIT_INPUT)


@click.command("specs")
@click.option("--json", "as_json", is_flag=True, help="Print the list as JSON.")
def specs_cmd(as_json: bool) -> None:
    """List the built-in specs and the model classes each one fits."""
    from symspec.spec import builtin_index

    index = builtin_index()
    if as_json:
        echo_json(index)
        return
    from rich.table import Table

    table = Table(title="built-in specs", title_justify="left")
    table.add_column("name")
    table.add_column("models")
    table.add_column("description")
    for name, h in index.items():
        table.add_row(name, ", ".join(h["models"]), h["description"])
    stdout_console().print(table)


@click.command("schema")
@click.option("--out", help="Write to this file instead of stdout.")
@click.option("--force", is_flag=True, help="Replace --out if it exists.")
@handle_errors
def schema_cmd(out: str | None, force: bool) -> None:
    """Print the JSON Schema of the spec format (for editor validation)."""
    import json

    from symspec.spec.schema import json_schema

    text = json.dumps(json_schema(), indent=2)
    if out:
        from pathlib import Path

        from symspec.outputs import Target, check_outputs, publish_bytes

        target = Target(Path(out), "--out")
        for note in check_outputs([target], [], force=force):
            click.echo(f"note: {note}", err=True)
        publish_bytes([(target, (text + "\n").encode("utf-8"))], force=force)
        click.echo(f"wrote {out}", err=True)
    else:
        click.echo(text)
