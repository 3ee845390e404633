"""``symspec infer MODEL``: draft a spec from the traced graph, check it, write it."""

from __future__ import annotations

import sys

import click

from ._common import EXIT_FAIL, EXIT_OK, echo_json, handle_errors, progress_messages, stderr_console
from .check import MAX_BATCH, MAX_SEED


@click.command("infer")
@click.argument("model_file", metavar="MODEL")
@click.option("--out", metavar="SPEC.yaml", help="Write the spec here (default: print it).")
@click.option("--force", is_flag=True, help="Replace --out if it exists (never an input).")
@click.option("--name", metavar="NAME", callback=lambda ctx, param, value: _spec_name(value),
              help="The spec's name (default: from the model's class).")
@click.option("--model", "factory", metavar="MODEL.py", help="For a state-dict checkpoint: the model file whose build() makes its module.")
@click.option("--samples", default=2, show_default=True, type=click.IntRange(1, 100), help="Random group elements per space in each check.")
@click.option("--seed", default=0, show_default=True, type=click.IntRange(0, MAX_SEED), help="Seed of the sampled elements and inputs.")
@click.option("--batch", default=2, show_default=True, type=click.IntRange(1, MAX_BATCH), help="Batch size of the random inputs.")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON report (the spec's text is in it) instead of the spec.")
@handle_errors
def infer_cmd(model_file: str, out: str | None, force: bool, name: str | None, factory: str | None, samples: int, seed: int,
              batch: int, as_json: bool) -> None:
    """Draft a spec for MODEL from its traced graph, check it, and write it.

    MODEL is what `symspec check` takes: a Python file defining build() (or `model`) and
    example_inputs(), a Hugging Face model folder, or a state-dict checkpoint with --model.
    The graph (torch.export) shows the residual stream and its norms, the attention heads
    (rotary tables, grouped key/value heads), the MLP units and their nonlinearities; each
    space gets the largest group that evidence allows, and the draft is checked. A space
    whose check fails is shrunk to the next smaller group (GL -> O -> S -> identity) and
    checked again. Exit 0 when the written spec passes its check; 1 when nothing could be
    verified or the draft fails (it is written all the same, marked unverified in its
    header, each problem listed there); 2 for bad input.
    """
    from pathlib import Path

    from symspec.inference import infer
    from symspec.loading import load_model
    from symspec.outputs import Target, check_outputs, publish_bytes

    target = Target(Path(out), "--out") if out else None
    inputs_paths = [model_file] + ([factory] if factory else [])
    if target is not None:
        for note in check_outputs([target], inputs_paths, force=force):
            click.echo(f"note: {note}", err=True)
    loaded = load_model(model_file, factory=factory)
    inputs = loaded.example_inputs(batch=batch, seed=seed)
    with progress_messages("infer") as say:  # a bar on a terminal, a line every few seconds in a log
        result = infer(loaded.model, inputs, name=name, samples=samples, seed=seed, source=str(loaded.source), progress=say)
    ok = result.verified
    # what failed is written too, marked unverified in its header (exit 1): a user can read
    # the draft and fix it
    if target is not None:
        publish_bytes([(target, result.yaml.encode("utf-8"))], force=force)
    if as_json:
        echo_json({**result.to_dict(), "out": out})
    else:
        _summary(result, out)
        if target is None:
            click.echo(result.yaml, nl=False)
    sys.exit(EXIT_OK if ok else EXIT_FAIL)


def _spec_name(value: str | None) -> str | None:
    """--name as given, or a usage error (one line, exit 2) when it cannot be a spec's name."""
    if value is None:
        return None
    from symspec.inference.api import name_problem

    problem = name_problem(value)
    if problem:
        raise click.BadParameter(problem, param_hint="--name")
    return value


def _summary(result, out: str | None) -> None:  # type: ignore[no-untyped-def]
    """What was found, on stderr (the spec itself goes to stdout or --out)."""
    from rich.markup import escape

    console = stderr_console()
    console.soft_wrap = True  # long names and paths wrap at the terminal, never inside a word
    console.print(f"[bold]symspec infer[/]: {result.draft.model_class} -> spec '{result.draft.name}'")
    for s in result.spaces:
        console.print(f"  [cyan]{escape(s.name)}[/]: {escape(s.group)}")
        for e in s.evidence:
            console.print(f"      {e}", markup=False, highlight=False)
        for sh in s.shrunk:
            console.print(f"      [yellow]shrunk[/] {escape(sh)}", highlight=False)
    if result.unexplained:
        console.print("  left invariant:")
        for where, why in result.unexplained:
            console.print(f"      {where}: {why}", markup=False, highlight=False)
    for note in result.notes:
        console.print(f"  note: {note}", markup=False, highlight=False)
    where = f"; wrote it to {out}" if out else ""
    if result.error is not None:
        console.print("[red]the draft could not be checked[/]: it does not fit the model", highlight=False)
        for line in result.error.splitlines():
            console.print(f"      {line}", markup=False, highlight=False)
        console.print(f"[red]unverified[/]: the draft is marked so in its header{where}", highlight=False)
    elif not result.spaces:
        console.print(f"[red]no symmetry could be verified[/]: the spec declares no space{where}, marked unverified",
                      highlight=False)
    elif result.passed:
        console.print(f"[green]the spec passes its check[/] ({result.attempts} round(s))" + (f"; wrote {out}" if out else ""))
    else:
        console.print(f"[red]the draft still fails its check[/]{where}, marked unverified in its header", highlight=False)
