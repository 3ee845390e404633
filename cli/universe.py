"""``symspec universe MODEL... --out DIR``: align many models into one universe and merge them."""

from __future__ import annotations

import math
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import click

from ._bounds import BATCH_SIZE, SEED, STEPS
from ._common import (
    EXIT_OK,
    FiniteFloat,
    MethodChoice,
    data_inputs,
    default_method,
    echo_json,
    handle_errors,
    learned_options,
    progress_bar,
    resolve_spec,
    stderr_console,
    stdout_console,
)
from ._device import DEVICE

#: worker processes, Ray tasks in flight, torch threads: beyond this a value is a typo
MAX_WORKERS = 1024
#: grid points of the simplex (--resolution K with n models: C(K + n - 1, n - 1)); the
#: grid is built in memory and each point is a full evaluation of the split
MAX_SIMPLEX_POINTS = 100_000


@click.command("universe")
@click.argument("models", nargs=-1, required=True, metavar="MODEL...")
@click.option("--out", "out", required=True, metavar="DIR",
              help="Folder to write: merged model, aligned/ models, transforms/ records, report.json (written "
                   "atomically; refused if it exists unless --overwrite, and always if it is, holds or lies "
                   "inside an input).")
@click.option("--spec", "spec_arg", metavar="PATH|NAME",
              help="Spec (default: the model file's SPEC, else the built-in spec for the model's class).")
@click.option("--model", "factory", metavar="MODEL.py",
              help="For state-dict checkpoints: the model file whose build() makes their module "
                   "(default: the first MODEL that is a model file). Beside Hugging Face folders it lends "
                   "its data()/loss() hooks to --data.")
@click.option("--groups", default=None, metavar="full|perm|perm,SPACE=full",
              help="Groups to search: full (default), perm (permutations only), or per declared space.")
@click.option("--method", default=None, type=MethodChoice(),
              help="The alignment method that aligns each model onto the universe in every round: any registered "
                   "one (`symspec methods` lists them; a data-driven one aligns on the train split of --data). A "
                   "method registered at run time reaches worker processes through an entry point or --setup.  "
                   "[default: weight; with --data, auto: the closed-form methods tried on each alignment, the "
                   "best by the validation loss kept]")
@click.option("--rounds", default=10, show_default=True, type=click.IntRange(1, 10000),
              help="At most this many rounds (align every model, then average).")
@click.option("--tol", default=1e-4, show_default=True, type=FiniteFloat(min=0.0),
              help="Stop once a round lowers the objective by less than this fraction.")
@click.option("--start", "start_arg", default="0", show_default=True, metavar="INDEX|MODEL",
              help="The model the universe starts from; the merged model keeps its class and format.")
@click.option("--jobs", "-j", type=click.IntRange(1, MAX_WORKERS), default=None,
              help="Worker processes aligning the models of a round in parallel (each holds one model at a "
                   "time). With --ray: tasks in flight (default: the cluster's CPUs).  [default: 1]")
@click.option("--ray", "ray_address", metavar="ADDRESS",
              help="Run the rounds as Ray tasks: 'auto', 'ray://HOST:10001', HOST:PORT, or 'local' (a "
                   "single-node cluster started here). The models and --out must be on storage every node reads.")
@click.option("--device", default="cpu", show_default=True, type=DEVICE,
              help="Where each alignment's dense work runs: cpu, cuda or cuda:N.")
@click.option("--threads", default=1, show_default=True, type=click.IntRange(1, MAX_WORKERS),
              help="Torch threads per alignment (the same in every executor, so results are identical).")
@click.option("--data", "data_arg", metavar="SOURCE",
              help="Evaluate the merged model against the endpoints and plain averaging on this data "
                   "(and, for a data-driven --method, align on its train split) "
                   "(text:PATH, images:DIR, hf:DIR, mnist:DIR, digits, hook; see docs/analyzers.md); for 3 models also the "
                   "loss over the simplex (simplex.png).")
@click.option("--split", default="val", show_default=True, type=click.Choice(["train", "val", "test"]),
              help="Which split --data evaluates.")
@click.option("--batch-size", default=64, show_default=True, type=BATCH_SIZE, help="Examples per forward pass.")
@click.option("--max-samples", type=click.IntRange(min=1), help="Use at most this many examples of the split.")
@click.option("--simplex/--no-simplex", "simplex", default=None,
              help="Evaluate the loss over the simplex of the models (default: with 3 models or fewer).")
@click.option("--resolution", type=click.IntRange(min=1), metavar="K",
              help="Simplex grid: weights in steps of 1/K (default: 12 for 3 models, coarser for more).")
@click.option("--overwrite", "--force", "overwrite", is_flag=True, help="Replace --out if it exists.")
@click.option("--resume/--no-resume", default=True, show_default=True,
              help="Resume an unfinished run of the same command (its work is kept in .DIR.partial next to --out, "
                   "locked while a run uses it).")
@click.option("--setup", "worker_setup", metavar="MODULE:FUNCTION",
              help="Called once in every worker process (to register custom groups, solvers or alignment methods).")
@click.option("--steps", "learn_steps", type=STEPS, metavar="N",
              help="--method learned: steps of the learned refinement.  [default: 500]")
@click.option("--lr", "learn_lr", type=FiniteFloat(min=0.0), help="--method learned: peak learning rate.  [default: 1e-2]")
@click.option("--alpha", "learn_alpha", type=FiniteFloat(min=0.0),
              help="--method learned: the merging weights are drawn from Dirichlet(alpha 1).  [default: 0.1]")
@click.option("--seed", "learn_seed", type=SEED, help="--method learned: seed of batch order and weights.  [default: 0]")
@click.option("--micro-batch", "learn_micro_batch", type=BATCH_SIZE, metavar="N",
              help="--method learned: examples per forward pass; a step's batch runs in pieces whose gradients add "
                   "up.  [default: the whole batch]")
@click.option("--autocast", "learn_autocast", type=click.Choice(["bfloat16", "float16"]),
              help="--method learned: the training forward passes in this precision (torch.autocast).  [default: off]")
@click.option("--json", "as_json", is_flag=True, help="Print the JSON report instead of tables.")
@handle_errors
def universe_cmd(models: tuple[str, ...], out: str, spec_arg: str | None, factory: str | None, groups: str | None,
                 method: str | None, rounds: int, tol: float, start_arg: str, jobs: int | None, ray_address: str | None,
                 device: str, threads: int, data_arg: str | None, split: str, batch_size: int,
                 max_samples: int | None, simplex: bool | None, resolution: int | None, overwrite: bool,
                 resume: bool, worker_setup: str | None, learn_steps: int | None, learn_lr: float | None,
                 learn_alpha: float | None, learn_seed: int | None, learn_micro_batch: int | None,
                 learn_autocast: str | None, as_json: bool) -> None:
    """Align every MODEL into one shared universe and merge them (universe matching).

    The universe starts as one model; each round aligns every model to it with the
    alignment method (weight matching by default; with --data, auto: the closed-form
    methods tried on each alignment, the best by the validation loss kept) under the
    spec's groups and sets it to
    the mean of the aligned models, until the objective stops improving (the sum of
    squared distances to the universe; a data-driven method's own objective, summed over
    the models' alignments). Every model gets one transform into the universe, so
    any two are aligned through it. With --method learned --data, weight matching's
    rounds are followed by the learned refinement: every transform trained for the loss
    of merged models with Dirichlet(--alpha) weights.

    MODEL: model files, Hugging Face folders or checkpoints (with --model); globs
    ('runs/*/model.pt') and list files ('@models.txt', one path a line) are expanded.
    Exit 0 on success, 2 for bad input (a missing or unreadable file, models of another
    architecture) or a failed worker; a failed run keeps its finished work and a rerun
    of the same command resumes it.
    """
    from symspec.errors import SymspecError
    from symspec.outputs import work_folder
    from symspec.universe import round_method

    started = time.perf_counter()
    method = default_method(method, data_arg)
    m = round_method(method, data_arg)  # before any work: a method universe matching cannot run
    options = learned_options(m, {"steps": ("--steps", learn_steps), "lr": ("--lr", learn_lr),
                                  "dirichlet": ("--alpha", learn_alpha), "seed": ("--seed", learn_seed),
                                  "micro_batch": ("--micro-batch", learn_micro_batch),
                                  "autocast": ("--autocast", learn_autocast)})
    paths, factory, start = _check_inputs(models, out, spec_arg, factory, data_arg, start_arg, ray_address, simplex,
                                          resolution, overwrite)
    out_dir = Path(out)
    partial = work_folder(out_dir)
    try:
        _run(paths, factory, start, out_dir, partial, spec_arg, groups, method, m, options, rounds, tol, jobs,
             ray_address, device, threads, data_arg, split, batch_size, max_samples, simplex, resolution, overwrite,
             resume, worker_setup, as_json, started)
    except Exception as e:
        from symspec.outputs import is_write_error, write_error

        if isinstance(e, SymspecError) or not is_write_error(e):
            raise
        # a write the layers below did not name (they do, as one line): never a traceback
        raise write_error(getattr(e, "filename", None) or partial, e) from e
    sys.exit(EXIT_OK)


def _run(paths: list[str], factory: str | None, start: int | str, out_dir: Path, partial: Path, spec_arg: str | None,
         groups: str | None, method: str, m: Any, options: Any, rounds: int, tol: float, jobs: int | None,
         ray_address: str | None, device: str, threads: int, data_arg: str | None, split: str, batch_size: int,
         max_samples: int | None, simplex: bool | None, resolution: int | None, overwrite: bool, resume: bool,
         worker_setup: str | None, as_json: bool, started: float) -> None:
    """The run, its outputs and what it prints."""
    from symspec.errors import SymspecInputError
    from symspec.outputs import FolderLock, is_write_error
    from symspec.universe import build_report, save_outputs, universe_match
    from symspec.universe.errors import WorkWriteError, resume_hint

    # held from here to the end: a second run on the same --out fails at once instead
    # of sharing (and removing) this run's work folder
    with FolderLock(partial, remove_if_empty=True):
        spec = spec_arg if spec_arg is not None else _default_spec(paths, start, factory)
        with _Progress(stderr_console(), quiet=as_json) as bar:
            align_data = _align_data(paths, start, factory, data_arg, batch_size, max_samples) if m.needs_data else None
            # a method that picks a step validates on val, never on the evaluated split
            # (evaluating val, it holds out part of train instead)
            validation = (_align_data(paths, start, factory, data_arg, batch_size, max_samples, split="val")
                          if getattr(m, "validates", False) and split == "test" else None)
            result = universe_match(paths, spec, rounds=rounds, tol=tol, groups=groups, method=method, jobs=jobs,
                                    ray=ray_address, device=device, start=start, factory=factory, workdir=partial,
                                    resume=resume, progress=bar.event, threads=threads, worker_setup=worker_setup,
                                    load_aligned=False, keep_workdir=True, data=align_data, validation=validation,
                                    options=options)
            analysis = None
            if data_arg is not None:
                analysis = _analyze(result, paths, factory, data_arg, split, batch_size, max_samples, device, simplex,
                                    resolution, bar)
        report = build_report(result, analysis, seconds=time.perf_counter() - started)
        plot_name = "simplex.png" if analysis is not None and any(len(s.names) == 3 for s in analysis.surfaces) else None

        def extra(tmp: Path) -> None:
            if plot_name and analysis is not None:
                analysis.plot(tmp / plot_name)

        try:
            written = save_outputs(result, out_dir, report=report, overwrite=overwrite, extra=extra,
                                   extra_outputs={"simplex_plot": plot_name} if plot_name else None)
        except SymspecInputError as e:
            cause = e.__cause__
            if cause is None or not is_write_error(cause):
                raise
            # --out could not be written (a full disk): the rounds are done and kept
            code = cause.errno if isinstance(cause, OSError) else None
            raise WorkWriteError(str(e) + resume_hint(WorkWriteError(str(e), code), partial, True), code) from e
        shutil.rmtree(partial, ignore_errors=True)
    report["outputs"] = written
    if as_json:
        echo_json(report)
    else:
        _print(report, result, analysis, written, plot_name and str(out_dir / plot_name))


def _check_inputs(models: tuple[str, ...], out: str, spec_arg: str | None, factory: str | None, data_arg: str | None,
                  start_arg: str, ray_address: str | None, simplex: bool | None, resolution: int | None,
                  overwrite: bool) -> tuple[list[str], str | None, int | str]:
    """Everything that can be refused before any work: the models (expanded), the
    simplex's size, the Ray address, the outputs against the inputs, ``--start``.
    Returns the model paths, the factory (default: the first model file) and the start."""
    from symspec.outputs import Target, check_outputs, check_overlap, work_folder
    from symspec.universe import UniverseError, expand_models

    paths = expand_models(models)
    if len(paths) < 2:
        raise UniverseError(f"universe matching needs at least 2 models, got {len(paths)}")
    if resolution is not None and data_arg is not None and (len(paths) <= 3 if simplex is None else simplex):
        points = math.comb(resolution + len(paths) - 1, len(paths) - 1)
        if points > MAX_SIMPLEX_POINTS:
            raise UniverseError(f"--resolution {resolution}: the simplex of {len(paths)} models would have {points:.3g} "
                                f"grid points (at most {MAX_SIMPLEX_POINTS}); use a smaller --resolution or --no-simplex")
    if ray_address is not None:
        from symspec.runtime import check_ray_address

        check_ray_address(ray_address)  # before any work: an unreachable address fails in seconds
    if factory is None:
        factory = next((p for p in paths if p.endswith(".py")), None)
    # nothing may write over an input: the models, their lists, --model, --spec, --data
    inputs = [*paths, *(m[1:] for m in models if m.startswith("@")), factory, spec_arg, *data_inputs(data_arg)]
    notes = check_outputs([Target(Path(out), "--out", folder=True)], inputs, force=overwrite, flag="--overwrite")
    check_overlap(work_folder(Path(out)), "the work folder", inputs)
    from symspec.universe.inputs import model_keys
    from symspec.universe.workdir import check_paths, deepest_paths

    # the names of the files the run writes, in the work folder and in --out, not only --out's
    check_paths(out, deepest_paths(work_folder(Path(out)), model_keys(paths), out))
    for note in notes:
        click.echo(f"note: {note}", err=True)
    start: int | str = int(start_arg) if start_arg.lstrip("-").isdigit() else start_arg
    if isinstance(start, int) and not 0 <= start < len(paths):
        raise UniverseError(f"--start {start}: not a model's index (0 to {len(paths) - 1} for {len(paths)} models)")
    missing = [p for p in paths if not Path(p).exists()]
    if missing:
        raise UniverseError(f"no such file or folder: {', '.join(missing)}")
    return paths, factory, start


def _default_spec(paths: list[str], start: int | str, factory: str | None) -> Any:
    """The start model's SPEC, else the built-in spec for its class (as ``symspec check``)."""
    from symspec.loading import load_model

    first = load_model(paths[start] if isinstance(start, int) else paths[0], factory=factory)
    return resolve_spec(None, first.model, first.spec_hint())


def _align_data(paths: list[str], start: int | str, factory: str | None, data_arg: str | None, batch_size: int,
                max_samples: int | None, split: str = "train") -> Any:
    """A split of --data (the train split, for a data-driven method's rounds)."""
    from symspec.data import check_fits, hooks_module, load_data
    from symspec.loading import load_model

    ref = load_model(paths[start] if isinstance(start, int) else paths[0], factory=factory)
    data = load_data(data_arg, model=ref.model, module=hooks_module(ref, factory), split=split,
                     batch_size=batch_size, max_samples=max_samples, model_dir=ref.source)
    check_fits(ref.model, data, ref.name)
    return data


def _analyze(result: Any, paths: list[str], factory: str | None, data_arg: str, split: str, batch_size: int,
             max_samples: int | None, device: str, simplex: bool | None, resolution: int | None, bar: Any) -> Any:
    from symspec.analyzers.simplex import analyze_merge, evaluations
    from symspec.data import check_fits, hooks_module, load_data
    from symspec.loading import load_model
    from symspec.universe import UniverseError

    ref = result.reference
    if ref is None or result.canonical_model is None:
        raise UniverseError("--data needs the models as modules (model files, Hugging Face folders or checkpoints with --model)")
    # beside Hugging Face folders, --model lends its data()/loss() hooks
    data = load_data(data_arg, model=ref.model, module=hooks_module(ref, factory), split=split, batch_size=batch_size,
                     max_samples=max_samples, model_dir=ref.source)
    check_fits(ref.model, data, ref.name)
    n = len(paths)
    bar.start_task("evaluating", evaluations(n, data, simplex=simplex, resolution=resolution))

    def raw(i: int) -> Any:
        return {k: v.detach() for k, v in load_model(paths[i], factory=factory).model.state_dict().items()}

    return analyze_merge(module=ref.model, canonical_module=result.canonical_model, n=n, names=result.names,
                         load_raw=raw, load_aligned=result.aligned_state, merged=result.merged, data=data,
                         device=device, simplex=simplex, resolution=resolution, progress=bar.advance)


class _Progress:
    """Rich progress on stderr: one bar per phase, a line per finished round."""

    def __init__(self, console: Any, quiet: bool) -> None:
        self.console = console
        self.quiet = quiet
        self.bar: Any = None
        self.task: Any = None
        self.phase = ""
        self.last = math.nan

    def __enter__(self) -> _Progress:
        if not self.quiet:
            self.bar = progress_bar(self.console)
            self.bar.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.bar is not None:
            self.bar.__exit__(*exc)

    def start_task(self, description: str, total: int) -> None:
        if self.bar is None:
            return
        if self.task is not None:
            self.bar.remove_task(self.task)
        self.task = self.bar.add_task(description, total=total)
        self.phase = description

    def advance(self, n: int = 1) -> None:
        if self.bar is not None and self.task is not None:
            self.bar.update(self.task, advance=n)

    def event(self, e: Any) -> None:
        if e.kind == "note":  # one line, with --json too (on stderr): a resumed or recomputed part
            if self.bar is None:
                click.echo(f"note: {e.message}", err=True)
            else:
                from rich.text import Text

                self.bar.console.print(Text(f"note: {e.message}", style="yellow"), soft_wrap=True)
            return
        if self.bar is None:
            return
        if e.kind in ("prepare", "align"):
            phase = "loading models" if e.kind == "prepare" else f"round {e.round}: aligning"
            if phase != self.phase:
                self.start_task(phase, e.total)
            self.bar.update(self.task, completed=e.done)
        elif e.kind == "learn":
            if self.phase != "learned refinement":
                self.start_task("learned refinement", e.total)
            self.bar.update(self.task, completed=e.done, description=f"learned refinement: loss {e.objective:.4g}")
        elif e.kind == "round":
            change = ""
            if math.isfinite(self.last) and self.last > 0:
                change = f" ({(e.objective - self.last) / self.last:+.2%})"
            self.last = e.objective
            self.bar.console.print(f"round {e.round}: objective {e.objective:.6g}{change}, {e.seconds:.1f} s")


def _print(report: dict[str, Any], result: Any, analysis: Any, written: dict[str, Any], plot: str | None) -> None:
    from rich.table import Table

    console = stdout_console()
    hist = report["objective"]
    head = (f"symspec universe: {len(result.models)} models, spec {report['spec']} ({report['groups']} groups), "
            f"{report['rounds']} round(s), {'converged' if report['converged'] else 'not converged'}, "
            f"{report['executor']} x{report['jobs']}")
    console.print(head)
    ref = result.refinement
    if ref is not None:
        console.print(f"learned refinement ({result.method}): {ref['steps']} steps, Dirichlet({ref['alpha']:g}) weights; "
                      f"uniform merge on {ref['validation']}: {ref['history'][0]:.4g} -> {ref['best_val_merged_loss']:.4g} "
                      f"(best step {ref['best_step']})")
    own = report.get("method_objective") or []
    on_method = report.get("converged_on") == "method" and own
    title = "objective: sum of squared distances to the universe"
    if on_method:
        title += f"; {report['method']}'s own objective (what the rounds stop on): its alignments' sum"
    rounds = Table(title=title, title_justify="left")
    for col in ("round", "objective", "relative", *(["method objective"] if on_method else []), "seconds"):
        rounds.add_column(col, justify="right")
    rounds.add_row("0", f"{hist[0]:.6g}", "1", *([f"{own[0]:.6g}"] if on_method else []), "")
    for info in report["per_round"]:
        r = info["round"]
        rounds.add_row(str(r), f"{hist[r]:.6g}", f"{report['relative_objective'][r]:.4f}",
                       *([f"{own[r]:.6g}"] if on_method else []), f"{info['seconds']:.1f}")
    console.print(rounds)
    models = Table(title="models: squared distance to the universe", title_justify="left")
    cols = [("model", "left"), ("before", "right"), ("after", "right")]
    if analysis is not None:
        cols += [("loss", "right"), ("aligned loss", "right")]
    for col, just in cols:
        models.add_column(col, justify=just)  # type: ignore[arg-type]
    for k, m in enumerate(report["models"]):
        extra = [f"{analysis.endpoints[k].loss:.4f}", f"{analysis.aligned[k].loss:.4f}"] if analysis is not None else []
        models.add_row(m["name"], f"{m['distance_before']:.6g}", f"{m['distance_after']:.6g}", *extra)
    console.print(models)
    if analysis is not None:
        t = Table(title=f"merged model on {analysis.data.get('source')} ({analysis.data.get('split')})", title_justify="left")
        for col in ("", "loss", "accuracy", "gap to endpoints' mean"):
            t.add_column(col, justify="right" if col else "left")
        mean = analysis.endpoint_mean

        def acc(x: Any) -> str:
            return "n/a" if x is None else f"{x:.4f}"

        t.add_row("endpoints (mean)", f"{mean:.4f}", acc(report["analysis"]["endpoints_mean"]["accuracy"]), "0")
        t.add_row("vanilla averaging", f"{analysis.plain.loss:.4f}", acc(analysis.plain.accuracy), f"{analysis.plain.loss - mean:+.4f}")
        merged = "universe matching" + (" + learned refinement" if result.refinement is not None else "")
        t.add_row(merged, f"{analysis.merged.loss:.4f}", acc(analysis.merged.accuracy), f"{analysis.merged.loss - mean:+.4f}")
        console.print(t)
        for s in analysis.surfaces:
            label = merged if s.method == "universe" else s.label
            console.print(f"simplex ({label}): max deviation {s.max_deviation:.4f} at weights "
                          f"{', '.join(f'{w:.2f}' for w in s.argmax)} ({len(s.weights)} points)")
    console.print(f"wrote {written['merged']}, {len(written['aligned'])} aligned models, transforms, {written['report']}"
                  + (f", {plot}" if plot else ""))
