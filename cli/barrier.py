"""``symspec barrier A B --data SOURCE``: loss along (1-λ)A + λB and the barrier."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import click

from ._bounds import BATCH_SIZE, LIFT_FREE_STEPS
from ._common import (
    EXIT_OK,
    MethodChoice,
    config_warning,
    data_inputs,
    echo_json,
    handle_errors,
    progress_bar,
    resolve_spec,
    stderr_console,
    stdout_console,
)
from ._device import DEVICE

#: each point is a full evaluation of the split; more than this is a typo (1e11 once ran out of memory)
MAX_POINTS = 1001


@click.command("barrier")
@click.argument("model_a", metavar="A")
@click.argument("model_b", metavar="B")
@click.option("--data", "data_arg", metavar="SOURCE",
              help="text:PATH[,block=N][,tokenizer=DIR], images:DIR, hf:DIR, mnist:DIR[,size=N], digits, or hook "
                   "(the model file's data()); options: ,split=0.8/0.1/0.1 and more (docs/analyzers.md). Text is "
                   "tokenised with the model folder's tokenizer when it has one. Default: the model file's data().")
@click.option("--split", default="val", show_default=True, type=click.Choice(["train", "val", "test"]),
              help="Which split to evaluate on.")
@click.option("--align", "methods", multiple=True, type=MethodChoice(),
              help="Alignment before interpolating, any registered method (`symspec methods` lists them): "
                   "none (vanilla averaging), weight (weight matching with the spec's full groups), "
                   "weight-perm (permutations only), ... Repeat to compare methods on one report and figure. "
                   "Data-driven methods align on the train split of --data.  [default: none]")
@click.option("--points", default=11, show_default=True, type=click.IntRange(2, MAX_POINTS), metavar="K",
              help="Evaluated values of λ, evenly spaced from 0 to 1 (both endpoints included).")
@click.option("--pair", "pairs", multiple=True, nargs=2, metavar="A2 B2",
              help="Another pair of the same architecture (repeatable): barriers are then reported as mean ± standard error.")
@click.option("--model", "factory", metavar="MODEL.py",
              help="For state-dict checkpoints: the model file whose build() makes their module "
                   "(default: A or B when it is a model file). Beside Hugging Face folders it lends its "
                   "data()/loss() hooks.")
@click.option("--spec", "spec_arg", metavar="PATH|NAME", help="Spec for the alignment methods (default: the model file's SPEC, else the built-in spec for the model's class).")
@click.option("--device", default="cpu", show_default=True, type=DEVICE, help="Where to evaluate: cpu, cuda or cuda:N.")
@click.option("--dtype", "dtype_name", type=click.Choice(["float32", "float64"]), help="Evaluate in this precision (default: the model's).")
@click.option("--batch-size", default=64, show_default=True, type=BATCH_SIZE, help="Examples per forward pass.")
@click.option("--max-samples", type=click.IntRange(min=1), help="Use at most this many examples (sequences, images) of the split.")
@click.option("--plot", "plot_path", metavar="OUT.png", help="Write the curves (loss, and accuracy when it applies) as a PNG.")
@click.option("--report", "report_path", metavar="OUT.json", help="Write the JSON report to a file.")
@click.option("--markdown", "markdown_path", metavar="OUT.md", help="Write a markdown summary to a file.")
@click.option("--lift-free", "lift_free", type=LIFT_FREE_STEPS, default=0, metavar="N",
              help="Models of different widths, aligned methods: after aligning, train the lift's free directions "
                   "(the readers' weights off B's residual span) for N steps on the train split (docs/width.md).  "
                   "[default: 0, off]")
@click.option("--force", is_flag=True, help="Replace existing --plot/--report/--markdown files (never an input).")
@click.option("--json", "as_json", is_flag=True, help="Print the JSON report instead of tables.")
@handle_errors
def barrier_cmd(model_a: str, model_b: str, data_arg: str | None, split: str, methods: tuple[str, ...], points: int,
                pairs: tuple[tuple[str, str], ...], factory: str | None, spec_arg: str | None, device: str,
                dtype_name: str | None, batch_size: int, max_samples: int | None, plot_path: str | None,
                report_path: str | None, markdown_path: str | None, lift_free: int, force: bool, as_json: bool) -> None:
    """Evaluate the straight line from model A (λ=0) to model B (λ=1) and report the
    loss barrier: the largest excess of the loss over the line between the endpoints'
    losses, with the λ where it peaks.

    A and B are model files (model.py), Hugging Face folders, or state-dict checkpoints
    with --model. Exit 0 on success, 2 for bad input (data that do not fit the model,
    models of different shapes, an empty split, fewer than 2 points, an output file that
    exists without --force or is one of the inputs).
    """
    from symspec.outputs import Target, check_outputs

    outputs = [Target(Path(p), opt) for p, opt in ((report_path, "--report"), (plot_path, "--plot"),
                                                    (markdown_path, "--markdown")) if p]
    inputs = [model_a, model_b, *(p for pair in pairs for p in pair), factory, spec_arg, *data_inputs(data_arg)]
    for note in check_outputs(outputs, inputs, force=force):
        click.echo(f"note: {note}", err=True)

    import torch

    from symspec.alignment import get_method
    from symspec.analyzers.barrier import Measurer
    from symspec.analyzers.report import BarrierReport
    from symspec.data import hooks_module, load_data
    from symspec.loading import load_model

    methods = tuple(dict.fromkeys(methods)) or ("none",)
    all_pairs = [(model_a, model_b), *pairs]
    if factory is None:
        factory = next((p for pair in all_pairs for p in pair if p.endswith(".py")), None)
    started = time.perf_counter()
    loaded = [(load_model(a, factory=factory), load_model(b, factory=factory)) for a, b in all_pairs]
    first = loaded[0][0]
    # beside Hugging Face folders, --model lends its data()/loss() hooks
    data = load_data(data_arg, model=first.model, module=hooks_module(first, factory), split=split,
                     batch_size=batch_size, max_samples=max_samples, model_dir=first.source)
    notes = _config_warnings(loaded, all_pairs)
    chosen = [get_method(m) for m in methods]
    spec = _spec(spec_arg, first, chosen, loaded)
    align_data = None
    if any(m.needs_data for m in chosen) or (lift_free and any(m.canonical for m in chosen)):
        if split == "train":
            notes.append(_warn("warning: evaluating on the train split that data-driven methods align on"))
        align_data = load_data(data_arg, model=first.model, module=hooks_module(first, factory), split="train",
                               batch_size=batch_size, max_samples=max_samples, model_dir=first.source)
    align_validation = None
    if split == "test" and (any(getattr(m, "validates", False) for m in chosen) or lift_free):
        # methods that pick a step (learned matching) validate on the val split, never on
        # the evaluated one (evaluated on val, they hold out part of the train split)
        align_validation = load_data(data_arg, model=first.model, module=hooks_module(first, factory), split="val",
                                     batch_size=batch_size, max_samples=max_samples, model_dir=first.source)
    dtype = {"float32": torch.float32, "float64": torch.float64}[dtype_name] if dtype_name else None
    measurer = Measurer(data, points=points, device=device, dtype=dtype, align_data=align_data,
                        align_validation=align_validation)
    results = _measure(measurer, loaded, all_pairs, methods, spec,
                       {name: {"lift_free": lift_free} for name, m in zip(methods, chosen) if lift_free and m.canonical})
    report = BarrierReport.build(data, results, device=device, dtype=str(measurer.evaluated_dtype),
                                 seconds=time.perf_counter() - started, notes=notes)
    if outputs:
        from symspec.outputs import publish

        # all the files or none: one that fails (a full disk) takes the others back
        writers = {"--report": report.write_json, "--plot": report.plot,
                   "--markdown": lambda p: p.write_text(report.markdown(), encoding="utf-8")}
        publish([(t, writers[t.option]) for t in outputs], force=force)
    if as_json:
        echo_json(report.to_dict())
    else:
        _print(report, written=[p for p in (plot_path, report_path, markdown_path) if p])
    sys.exit(EXIT_OK)


def _spec(spec_arg: str | None, first: Any, chosen: list[Any], loaded: list[tuple[Any, Any]]) -> Any:
    """The spec, for aligned methods, and for vanilla averaging of models whose shapes
    differ: a narrower B is lifted into A's widths first (docs/width.md), which needs the
    spec. Without one that fits, models of other shapes are refused as before."""
    if any(m.canonical for m in chosen) or spec_arg:
        return resolve_spec(spec_arg, first.model, first.spec_hint())
    if all(_shapes(la.model) == _shapes(lb.model) for la, lb in loaded):
        return None
    from symspec.errors import SymspecInputError

    try:
        return resolve_spec(None, first.model, first.spec_hint())
    except SymspecInputError:
        return None  # the pair check says what differs


def _shapes(model: Any) -> dict[str, tuple[int, ...]]:
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


def _warn(line: str) -> str:
    click.echo(line, err=True)
    return line


def _config_warnings(loaded: list[tuple[Any, Any]], names: list[tuple[str, str]]) -> list[str]:
    """A warning (shown now, kept for the report) per pair whose configs differ."""
    warnings = (config_warning(la, lb, pair, "interpolation") for (la, lb), pair in zip(loaded, names))
    return [_warn(w) for w in warnings if w]


def _measure(measurer: Any, loaded: list[tuple[Any, Any]], names: list[tuple[str, str]], methods: tuple[str, ...],
             spec: Any, align_kw: dict[str, dict[str, Any]] | None = None) -> dict[str, list[Any]]:
    """Every pair's curve under every method, with a progress bar (``align_kw``: per
    method, keywords for :func:`symspec.align`)."""
    total = len(names) * len(methods) * measurer.batches_per_curve
    results: dict[str, list[Any]] = {m: [] for m in methods}
    with _progress(total, quiet=False) as advance:
        for i, ((la, lb), (na, nb)) in enumerate(zip(loaded, names)):
            for j, m in enumerate(methods):
                advance(0, f"pair {i + 1}/{len(names)}, {m}")
                results[m].append(measurer.pair(la.model, lb.model, method=m, spec=spec, pair=i, names=(na, nb),
                                                progress=lambda n: advance(n, None), check_data=j == 0,
                                                align_kw=(align_kw or {}).get(m)))
    return results


class _progress:
    """A rich progress bar on stderr (a plain line every few seconds when stderr is not a
    terminal: :func:`progress_bar`)."""

    def __init__(self, total: int, quiet: bool) -> None:
        self.total = total
        self.quiet = quiet
        self.bar: Any = None

    def __enter__(self) -> Any:
        # not a terminal: no bar drawn (a drawn bar's end left an empty line before an
        # error), a plain line every few seconds instead
        if not self.quiet:
            self.bar = progress_bar(stderr_console(), "barrier")
            self.bar.__enter__()
            self.task = self.bar.add_task("evaluating", total=self.total)

        def advance(n: int, description: str | None) -> None:
            if self.bar is not None:
                self.bar.update(self.task, advance=n, **({"description": description} if description else {}))

        return advance

    def __exit__(self, *exc: Any) -> None:
        if self.bar is not None:
            self.bar.__exit__(*exc)


def _print(report: Any, written: list[str]) -> None:
    from rich.table import Table

    from symspec.analyzers.barrier import method_label

    d = report.data
    console = stdout_console()
    sums = report.summaries()
    title = (f"symspec barrier: {d['source']} ({d['split']}, {d['examples']} examples), "
             f"{len(report.lambdas)} points, {len(report.pairs)} pair(s)")
    table = Table(title=title, title_justify="left")
    for col, just in (("method", "left"), ("pairs", "right"), ("loss barrier", "right"), ("peak λ", "right"),
                      ("loss A", "right"), ("loss B", "right"), ("accuracy barrier", "right"), ("time", "right")):
        table.add_column(col, justify=just)  # type: ignore[arg-type]
    for m, s in sums.items():
        rs = report.results[m]
        se = f" ± {s.barrier_stderr:.4f}" if s.barrier_stderr is not None else ""
        acc = "n/a" if s.accuracy_barrier_mean is None else f"{s.accuracy_barrier_mean:.4f}" + (
            f" ± {s.accuracy_barrier_stderr:.4f}" if s.accuracy_barrier_stderr is not None else "")
        secs = sum(r.curve.seconds + r.align_seconds for r in rs)
        table.add_row(method_label(m), str(s.n), f"{s.barrier_mean:.4f}{se}", f"{s.peak_lambda_mean:.2f}",
                      f"{s.loss_a_mean:.4f}", f"{s.loss_b_mean:.4f}", acc, f"{secs:.1f} s")
    console.print(table)
    for m, rs in report.results.items():  # auto: which candidate each pair was aligned with
        won = [((r.align_info.get("info") or {}).get("auto") or {}).get("winner") for r in rs]
        if any(won):
            console.print(f"{m}: aligned with " + ", ".join(f"{w} (pair {i + 1})" for i, w in enumerate(won) if w))
    curves = Table(title="mean loss along the path", title_justify="left")
    curves.add_column("λ", justify="right")
    for m in sums:
        curves.add_column(method_label(m), justify="right")
    for k, lam in enumerate(report.lambdas):
        curves.add_row(f"{lam:.3f}", *(f"{s.loss_mean[k]:.4f}" for s in sums.values()))
    console.print(curves)
    for p in written:
        console.print(f"wrote {p}")
