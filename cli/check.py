"""``symspec check MODEL.py``."""

from __future__ import annotations

import sys

import click

from ._common import (
    EXIT_FAIL,
    EXIT_OK,
    echo_json,
    handle_errors,
    progress_messages,
    resolve_spec,
    stderr_console,
    stdout_console,
)
from ._device import DEVICE

#: seeds are mixed into torch generators (seed * 1000 + k must fit in 64 bits)
MAX_SEED = 2**32 - 1
#: the random inputs are a few sequences or images; a batch in the millions only exhausts memory
MAX_BATCH = 1024


def _parse_rtol(values: tuple[str, ...]) -> dict[str, float]:
    out = {}
    for v in values:
        dtype, sep, num = v.partition("=")
        if not sep or dtype not in ("float32", "float64"):
            raise click.BadParameter(f"expected float32=TOL or float64=TOL, got {v!r}", param_hint="--rtol")
        try:
            tol = float(num)
        except ValueError:
            raise click.BadParameter(f"{num!r} is not a number", param_hint="--rtol") from None
        # a relative error: 0 or less fails every row, 1 or more (and nan, inf) passes any
        if not 0 < tol < 1:
            raise click.BadParameter(f"{v!r}: the tolerance must be a number between 0 and 1 (exclusive)", param_hint="--rtol")
        out[dtype] = tol
    return out


@click.command("check")
@click.argument("model_file", metavar="MODEL")
@click.option("--spec", "spec_arg", metavar="PATH|NAME", help="Spec file or built-in name (default: the model file's SPEC, else the built-in spec for the model's class).")
@click.option("--samples", default=3, show_default=True, type=click.IntRange(1, 100), help="Random group elements per space.")
@click.option("--seed", default=0, show_default=True, type=click.IntRange(0, MAX_SEED), help="Seed of the sampled elements and inputs.")
@click.option("--dtype", "dtypes", default="float64,float32", show_default=True, help="Comma-separated precisions to check in.")
@click.option("--space", "spaces", multiple=True, metavar="NAME", help="Check only this declared space (repeatable).")
@click.option("--rtol", "rtols", multiple=True, metavar="DTYPE=TOL", help="Override a tolerance, e.g. --rtol float32=1e-3.")
@click.option("--model", "factory", metavar="MODEL.py", help="For a state-dict checkpoint: the model file whose build() makes its module.")
@click.option("--batch", default=2, show_default=True, type=click.IntRange(1, MAX_BATCH), help="Batch size of the random inputs.")
@click.option("--whole", is_flag=True, help="Check on whole-model copies in float64 and float32 instead of block by block (several times the model's memory).")
@click.option("--device", default="cpu", show_default=True, type=DEVICE, help="Where the block-by-block check runs.")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON report instead of a table.")
@handle_errors
def check_cmd(model_file: str, spec_arg: str | None, samples: int, seed: int, dtypes: str, spaces: tuple[str, ...],
              rtols: tuple[str, ...], factory: str | None, batch: int, whole: bool, device: str, as_json: bool) -> None:
    """Verify that the symmetries a spec declares preserve MODEL's function.

    MODEL is a Python file defining build() (or a `model` object) and
    example_inputs(model, batch, seed); or a Hugging Face model folder; or a
    state-dict checkpoint (.pt, .safetensors) with --model. For each declared space, random group
    elements are applied to the canonicalised weights and the outputs compared in
    float64 and float32, on the blocks (layers) the space acts on, one block at a time
    (--whole: on whole-model copies). Exit 0 when every row passes, 1 when any fails, 2 for bad
    input.
    """
    import shlex

    from symspec.checker import check
    from symspec.errors import SymspecInputError
    from symspec.loading import load_model

    dts = [d.strip() for d in dtypes.split(",") if d.strip()]
    bad = [d for d in dts if d not in ("float32", "float64")]
    if bad or not dts:
        raise click.BadParameter(f"unknown dtype {bad[0] if bad else dtypes!r}; use float64, float32", param_hint="--dtype")
    rtol = _parse_rtol(rtols)
    loaded = load_model(model_file, factory=factory)
    file_rtol = loaded.model_file.check_rtol() if loaded.model_file is not None else {}
    spec = resolve_spec(spec_arg, loaded.model, loaded.spec_hint(),
                        model_args=shlex.join([model_file, *(["--model", factory] if factory else [])]))
    inputs = loaded.example_inputs(batch=batch, seed=seed)  # run once: inputs the model cannot take are named here
    rtol = {**file_rtol, **rtol}
    console = stderr_console()
    explicit = click.get_current_context().get_parameter_source("dtypes") != click.core.ParameterSource.DEFAULT
    if device != "cpu" and whole:
        raise click.BadParameter("--whole runs on the CPU; drop --whole to check on the GPU", param_hint="--device")
    where = dict(whole=whole, device=device)

    def run(progress=None):  # type: ignore[no-untyped-def]
        nonlocal dts
        try:
            return check(loaded.model, spec, inputs, samples=samples, seed=seed, dtypes=dts, spaces=spaces or None,
                         rtol=rtol, progress=progress, source=str(loaded.source), **where)
        except SymspecInputError as e:
            # a float32-only kernel (a mixture of experts' grouped matmul): unless the user
            # asked for float64, check what can be checked and say so
            if explicit or "float32" not in dts or "failed in float64" not in str(e):
                raise
            dts = ["float32"]
            console.print(f"note: {str(e).split('; a model that')[0]}; checking in float32 only")
            return check(loaded.model, spec, inputs, samples=samples, seed=seed, dtypes=dts, spaces=spaces or None,
                         rtol=rtol, progress=progress, source=str(loaded.source), **where)

    with progress_messages("check") as say:  # a bar on a terminal, a line every few seconds in a log
        report = run(say)
    if as_json:
        echo_json(report.to_dict())
    else:
        _print_table(report)
    sys.exit(EXIT_OK if report.passed else EXIT_FAIL)


def _print_table(report) -> None:  # type: ignore[no-untyped-def]
    from rich.table import Table

    table = Table(title=f"symspec check: spec '{report.spec}' on {report.model}", title_justify="left")
    for col, just in (("space", "left"), ("group", "left"), ("dtype", "left"), ("samples", "right"),
                      ("max abs err", "right"), ("max rel err", "right"), ("rtol", "right"), ("result", "left")):
        # a failing row names steps and parameters: the result column takes what width is
        # left and folds them rather than cutting them off
        table.add_column(col, justify=just, no_wrap=col != "result", overflow="fold" if col == "result" else "ellipsis")  # type: ignore[arg-type]
    for r in report.rows:
        result = "[green]pass[/]" if r.passed else "[red]FAIL[/]" + (f" at {', '.join(r.failing)}" if r.failing else "")
        table.add_row(r.space, r.group, r.dtype, str(r.samples), f"{r.max_abs:.2e}", f"{r.max_rel:.2e}", f"{r.rtol:.0e}", result)
    console = stdout_console()
    console.print(table)
    for note in report.notes:
        console.print(note)
    if report.passed:
        console.print("[green]all symmetries preserve the function[/]")
    else:
        names = ", ".join(dict.fromkeys(r.space for r in report.failed_rows()))
        console.print(f"[red]{len(report.failed_rows())} row(s) failed:[/] {names}")
