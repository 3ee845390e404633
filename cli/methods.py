"""``symspec methods``: the registered alignment methods (what ``--method`` and ``--align`` accept)."""

from __future__ import annotations

import click

from ._common import echo_json, handle_errors, stdout_console


@click.command("methods")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
@handle_errors
def methods_cmd(as_json: bool) -> None:
    """List the alignment methods that match --method, merge --method, barrier --align and
    universe --method accept: the built-in ones and those of installed plugins (entry
    point group ``symspec.methods``)."""
    from symspec.alignment import get_method, method_names

    rows = [get_method(n) for n in method_names()]
    if as_json:
        echo_json([{"name": m.name, "label": m.label, "canonical": m.canonical, "needs_data": m.needs_data,
                    "groups": m.groups or "full", "candidate": bool(getattr(m, "candidate", False))} for m in rows])
        return
    from rich.table import Table

    table = Table()
    for col in ("method", "what it does", "needs --data", "groups searched", "auto tries it"):
        table.add_column(col)
    for m in rows:
        table.add_row(m.name, m.label, "yes" if m.needs_data else "no", m.groups or ("full" if m.canonical else "-"),
                      "yes" if getattr(m, "candidate", False) else "no")
    stdout_console().print(table)
