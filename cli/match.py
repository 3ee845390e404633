"""``symspec match A B --out DIR`` and ``symspec merge A B --alpha 0.5 --out DIR``.

Outputs are published by :mod:`symspec.outputs`: staged next to DIR and renamed into
place at the end, so a failure or an interrupt leaves nothing half-written; an existing
DIR is replaced only with --force, and never when it is, holds or lies inside an input.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from ._bounds import BATCH_SIZE, EPOCHS, LIFT_FREE_STEPS, SEED, STEPS
from ._common import (
    FiniteFloat,
    LrScale,
    MethodChoice,
    config_warning,
    data_inputs,
    default_method,
    echo_json,
    handle_errors,
    progress_bar,
    resolve_spec,
    stderr_console,
    stdout_console,
)
from ._device import DEVICE

#: how a bound that needs cvxpy says so (symspec.certify.joint.NEEDS_CVXPY; the
#: certificate's not_available lists those, printed in full instead of the joint reason)
NEEDS_CVXPY_MARK = "needs cvxpy"
#: timer phases measured inside the solve:<kind> phases
INNER_PHASES = {"assign", "score", "svd", "iterate", "heads:similarity"}

GROUPS_HELP = ("Groups searched: full (the spec's), perm (permutation subgroups: the paper's ablation), "
               "fixed, or per declared space, e.g. 'perm,attn=full'.  [default: the method's own: "
               "full, perm for weight-perm]")


def _input_error(msg: str) -> Exception:
    from symspec.errors import SymspecInputError

    return SymspecInputError(msg)


def check_output(out: Path, force: bool, inputs: list[str | None]) -> None:
    """Fail before any work when ``out`` cannot or must not be written (notes about stale
    staging folders go to stderr)."""
    from symspec.outputs import Target, check_outputs

    for note in check_outputs([Target(out, "--out", folder=True)], inputs, force=force):
        click.echo(f"note: {note}", err=True)


def publish(out: Path, force: bool, fill: Callable[[Path], None]) -> None:
    """Build the output folder with ``fill`` in a staging folder, then rename it into place."""
    from symspec.outputs import Target
    from symspec.outputs import publish as publish_outputs

    publish_outputs([(Target(out, "--out", folder=True), fill)], force=force)


def write_model(loaded: Any, state_dict: Any, folder: Path) -> list[str]:
    """Write the model into ``folder`` in the format it was read in: a Hugging Face folder
    becomes the folder itself; a file becomes ``model<suffix>`` (``.pt`` for model files)."""
    from symspec.loading import save_model

    if loaded.format == "hf":
        tmp = folder / ".model"
        save_model(loaded, state_dict, tmp)
        names = []
        for f in tmp.iterdir():
            os.replace(f, folder / f.name)
            names.append(f.name)
        tmp.rmdir()
        return sorted(names)
    suffix = loaded.source.suffix if loaded.format in ("state_dict", "safetensors") else ".pt"
    target = folder / f"model{suffix}"
    save_model(loaded, state_dict, target)
    return [target.name]


class _Progress:
    """A rich progress line on stderr, fed by MatchEvents (a plain line every few seconds
    when stderr is not a terminal: :func:`progress_bar`)."""

    def __init__(self, enabled: bool) -> None:
        self.bar = progress_bar(stderr_console(), "match", spinner=True, disable=not enabled)
        self.task: Any = None

    def __enter__(self) -> _Progress:
        self.bar.__enter__()
        self.task = self.bar.add_task("loading", total=None)
        return self

    def __exit__(self, *exc: Any) -> None:
        self.bar.__exit__(*exc)

    def phase(self, text: str) -> None:
        self.bar.update(self.task, description=text)

    def __call__(self, event: Any) -> None:
        if event.kind == "start":
            self.bar.update(self.task, description=f"matching: objective {event.objective:.4g}", total=event.total, completed=0)
        elif event.kind == "space":
            self.bar.update(self.task, description=f"round {event.round}/{event.rounds}: {event.space}, objective {event.objective:.4g}",
                            completed=event.done, total=event.total)
        elif event.kind == "step":
            self.bar.update(self.task, description=f"learning: step {event.round}/{event.rounds}, loss {event.space}, "
                                                   f"midpoint loss (validation) {event.objective:.4g}",
                            completed=event.done, total=event.total)
        elif event.kind == "statistics":
            self.bar.update(self.task, description=f"activation statistics: batch {event.round}/{event.rounds}, "
                                                   f"model {event.space}", completed=event.done, total=event.total)
        elif event.kind == "factor":
            self.bar.update(self.task, description=f"factoring activation statistics: {event.space}",
                            completed=event.done, total=event.total)
        elif event.kind == "round":
            self.bar.update(self.task, description=f"round {event.round} done: objective {event.objective:.4g}", completed=event.total)
        elif event.kind == "auto":
            self.bar.update(self.task, description=f"auto: candidate {event.round}/{event.rounds}, {event.space}", total=None)


def _print_candidates(console: Any, auto: dict[str, Any]) -> None:
    """``auto``'s candidates: each one's midpoint loss, time and objective, the winner marked."""
    from rich.table import Table

    console.print(f"auto: the candidates, scored by the loss at the midpoint on {auto['scored_on']} "
                  f"({auto['batches']} batch(es)); the lowest wins:")
    t = Table()
    for col, right in (("method", False), ("midpoint loss", True), ("seconds", True), ("", False)):
        t.add_column(col, justify="right" if right else "left")
    for c in auto["candidates"]:
        if "midpoint_loss" in c:
            mark = "winner" if c["method"] == auto["winner"] else ""
            t.add_row(c["method"], f"{c['midpoint_loss']:.6g}", f"{c['seconds']:.2f}", mark)
        else:
            t.add_row(c["method"], "", f"{c.get('seconds', 0.0):.2f}", c.get("error") or c.get("skipped", ""))
    console.print(t)
    console.print(f"aligned with {auto['winner']}: its objective per round follows")


def _quiet_threads() -> None:
    """Process settings for matching large models (:mod:`symspec.process`; a user's own
    settings win). Effective only before torch is imported, which the CLI has not done yet."""
    from symspec.process import configure_process

    configure_process()


def _load_pair(a: str, b: str, factory: str | None, spec_arg: str | None, progress: _Progress) -> tuple[Any, Any, Any]:
    from symspec.loading import load_model

    progress.phase("loading A")
    la = load_model(a, factory=factory)
    progress.phase("loading B")
    lb = load_model(b, factory=factory)
    spec = resolve_spec(spec_arg, la.model, la.spec_hint())
    if type(la.model) is not type(lb.model):
        raise _input_error(f"A is a {type(la.model).__name__} but B is a {type(lb.model).__name__}: they do not fit one spec")
    from symspec.width import lift_needed

    # different widths are lifted by align(); a depth difference or a narrower A is bad input, said now
    lift_needed(spec, la.model, lb.model)
    return la, lb, spec


#: learned matching's flags: click's parameter name -> (the flag, the LearnedOptions field)
LEARN_FLAGS = {"learn_steps": ("--steps", "steps"), "learn_epochs": ("--epochs", "epochs"), "learn_lr": ("--lr", "lr"),
               "learn_batch_size": ("--batch-size", "batch_size"), "learn_lambda": ("--lambda", "lam"),
               "learn_permutations": ("--permutations", "permutations"), "learn_seed": ("--seed", "seed"),
               "learn_init": ("--init", "init"), "learn_lr_scale": ("--lr-scale", "lr_scale"),
               "learn_micro_batch": ("--micro-batch", "micro_batch"), "learn_autocast": ("--autocast", "autocast"),
               "learn_average": ("--average", "average"), "learn_path_points": ("--path-points", "path_points")}


def learned_options(method: str, learn: dict[str, Any]) -> Any:
    """The learned-matching flags of match/merge as LearnedOptions (None when none is
    given; see :func:`symspec.cli._common.learned_options`)."""
    from symspec.alignment import get_method

    from ._common import learned_options as from_flags

    return from_flags(get_method(method), {field: (flag, learn.get(key)) for key, (flag, field) in LEARN_FLAGS.items()})


def _align(la: Any, lb: Any, spec: Any, method: str | None, data_arg: str | None, factory: str | None,
           progress: _Progress, learn: dict[str, Any] | None = None, **kw: Any) -> Any:
    """B aligned to A by the registered ``method``; data-driven methods get the train split
    of ``--data`` (and those that pick a step, the val split to pick it on). B's canonical
    copy is not kept (one copy of B less on large models)."""
    from symspec.alignment import align, get_method
    from symspec.errors import SymspecInputError

    from ._common import auto_options

    learn = dict(learn or {})
    m = get_method(default_method(method, data_arg))
    options = auto_options(m, learn.pop("auto_candidates", None), learn.pop("auto_budget", None))
    options = learned_options(m.name, learn) or options
    lift_free = kw.get("lift_free") or 0
    if lift_free and data_arg is None:
        raise SymspecInputError("--lift-free trains the lift's free directions on data: pass --data")
    data = validation = None
    if data_arg is not None or m.needs_data:
        if not m.needs_data and not lift_free:
            raise SymspecInputError(f"--data is for data-driven methods; '{m.name}' ({m.label}) reads none")
        from symspec.data import hooks_module, load_data

        progress.phase("loading data")
        data = load_data(data_arg, model=la.model, module=hooks_module(la, factory), split="train", model_dir=la.source)
        if getattr(m, "validates", False) or lift_free:
            validation = load_data(data_arg, model=la.model, module=hooks_module(la, factory), split="val",
                                   model_dir=la.source)
    progress.phase("binding and canonicalising")
    keep = kw.pop("keep_canonical_b", False)
    return align(la.model, lb.model, spec, method=m, data=data, validation=validation, progress=progress,
                 keep_canonical_b=keep, options=options, **kw)


def _summary(command: str, a: str, b: str, out: Path, files: list[str], result: Any, extra: dict[str, Any]) -> dict[str, Any]:
    data: dict[str, Any] = {"command": command, "a": a, "b": b, "out": str(out), "files": files}
    if result is not None:
        data.update(result.summary())
        data["distance"] = {"canonical": result.distance("canonical"), "aligned": result.distance("aligned")}
    data.update(extra)
    return data


def _loading_notes(data: dict[str, Any], *loaded: Any) -> dict[str, Any]:
    """``data`` with the notes of how its inputs were read (``LoadedModel.note``: a GGUF
    file was dequantised and is written back as a Hugging Face folder), where any."""
    notes = [lm.note for lm in loaded if getattr(lm, "note", None)]
    if notes:
        data["notes"] = notes
    return data


def _print_summary(data: dict[str, Any]) -> None:
    from rich.table import Table

    console = stdout_console()
    if "objective" in data:
        console.print(f"symspec {data['command']}: spec '{data['spec']}', method {data.get('method', 'weight')}, "
                      f"groups {data.get('groups', 'full')}")
        method = data.get("method", "weight")
        auto = data.get("info", {}).get("auto")
        if auto:
            _print_candidates(console, auto)
        if method.startswith("learned"):
            console.print("loss at the midpoint on the validation data, at the start and every "
                          f"{data['info'].get('eval_every', 'N')} steps (best step {data['info'].get('best_step')}):")
        else:
            console.print("objective per round" + (" (sum over the bound parameters of ||A - g.B||^2):"
                                                   if method.startswith("weight") else ":"))
        t = Table()
        t.add_column("round", justify="right")
        t.add_column("objective", justify="right")
        t.add_column("relative", justify="right")
        for i, (o, r) in enumerate(zip(data["objective"], data["relative_objective"])):
            t.add_row("start" if i == 0 else str(i), f"{o:.6g}", f"{r:.4f}")
        console.print(t)
        console.print("time per phase:")
        tt = Table()
        tt.add_column("phase")
        tt.add_column("seconds", justify="right")
        timings = data["timings"]
        inner = {k: v for k, v in timings.items() if k in INNER_PHASES}
        for k, v in sorted(((k, v) for k, v in timings.items() if k not in inner), key=lambda kv: -kv[1]):
            tt.add_row(k, f"{v:.3f}")
        for k, v in sorted(inner.items(), key=lambda kv: -kv[1]):
            tt.add_row(f"  within solve: {k}", f"{v:.3f}")
        console.print(tt)
        state = "converged" if data["converged"] else "stopped at --rounds"
        if method.startswith("learned"):
            info = data["info"]
            what = f"{info['steps']} step(s), the best at step {info['best_step']}, function check passed"
        else:
            what = f"{data['rounds']} round(s), {state}"
        console.print(f"{what}; weight distance {data['distance']['canonical']:.6g} -> {data['distance']['aligned']:.6g}")
    cert = data.get("certificate")
    if cert is not None:
        _print_certificate(console, cert)
    lifted = (data.get("info") or {}).get("lift")
    if lifted:
        spaces = ", ".join(f"{k} {v['from']} -> {v['to']} ({v['kind']})" for k, v in list(lifted["spaces"].items())[:6])
        more = len(lifted["spaces"]) - 6
        console.print(f"B was narrower: lifted into A's shape ({lifted['how']} lift) before aligning: {spaces}"
                      + (f" and {more} more" if more > 0 else ""))
        free = lifted.get("free")
        if free and "val_midpoint_loss" in free and free["check"]["passed"]:
            console.print(f"the lift's free directions ({len(free['params'])} readers) trained {free['steps']} step(s), "
                          f"the best at step {free['best_step']}: validation midpoint loss "
                          f"{free['val_midpoint_loss_before']:.4g} -> {free['val_midpoint_loss']:.4g}, B's function kept")
        elif free:
            console.print(f"the lift's free directions: {free.get('note', 'not trained')}")
    elif (data.get("info") or {}).get("lift_free"):
        console.print(f"--lift-free: {data['info']['lift_free']}")
    console.print(f"wrote {data['out']}: {', '.join(data['files'])}")
    for note in data.get("notes", []):  # how the inputs were read (a GGUF file: dequantised, written as a folder)
        console.print(f"note: {note}", markup=False, highlight=False)


def _print_certificate(console: Any, cert: dict[str, Any]) -> None:
    """The certificate in a few lines: the global bound, the per-space gaps, the joint relaxations."""
    if cert["available"]:
        console.print(f"certificate: the objective's global minimum is at least {cert['lower_bound']:.6g}; "
                      f"this result's gap {cert['gap']:.6g} ({100 * (cert['relative_gap'] or 0):.2f}% of its objective)")
    else:
        console.print(f"certificate: {cert['reason']}")
    spaces = cert.get("per_space") or []
    if spaces:
        exact = [s for s in spaces if s["kind"] == "exact"]
        open_ = [s for s in exact if s["optimal"] is False]
        relaxed = [s for s in spaces if s["kind"] == "relaxation"]
        line = f"  per space, the others fixed: {len(exact) - len(open_)} of {len(exact)} exact space(s) optimal"
        if open_:
            worst = max(open_, key=lambda s: s["gap"])
            line += f" (largest gap: {worst['space']} {worst['gap']:.3g})"
        if relaxed:
            line += (f"; {len(relaxed)} relaxed (GL/RoPE heads, quadratic), gap at most "
                     f"{max(s['gap'] or 0.0 for s in relaxed):.3g}")
        console.print(line)
    for j in cert.get("joint") or []:
        if j["available"]:
            what = "global minimum" if j["whole_objective"] else f"minimum over {', '.join(j['spaces'][:4])}"
            sdps = [name for name, size in (("Shor", j["lifted_size"]), ("Gram", j.get("gram_size", 0))) if size]
            how = f"{' and '.join(sdps)} SDP over the interacting spaces" if sdps else "exact, nothing lifted"
            console.print(f"  joint bound ({j['scope']}; {how}): the {what} is at least {j['bound']:.6g}; gap {j['gap']:.3g} "
                          f"({100 * (j['relative_gap'] or 0):.2f}%)")
            if j.get("found") is not None:
                console.print(f"    rounding the relaxation found an element with objective {j['found']:.6g}: this result "
                              f"is at least {j['value'] - j['found']:.3g} above the minimum")
        elif NEEDS_CVXPY_MARK not in j["reason"]:
            console.print(f"  joint bound ({j['scope']}): {j['reason'][:160]}")
    for line in cert.get("not_available") or []:  # in full: what is missing and how to get it
        console.print(f"  {line}", soft_wrap=True, markup=False)


def _common_options(fn: Callable[..., Any]) -> Callable[..., Any]:
    opts = [
        click.option("--spec", "spec_arg", metavar="PATH|NAME", help="Spec file or built-in name (default: A's model file SPEC, else the built-in spec for A's class)."),
        click.option("--out", "out", required=True, type=click.Path(path_type=Path), help="Output folder (written atomically)."),
        click.option("--method", default=None, type=MethodChoice(),
                     help="Alignment method, any registered one (`symspec methods` lists them).  [default: weight; "
                          "with --data, auto: every candidate method run, the one whose midpoint has the lowest "
                          "validation loss kept]"),
        click.option("--data", "data_arg", metavar="SOURCE",
                     help="For data-driven methods: the examples they align on (the train split of SOURCE; "
                          "same syntax as barrier's --data)."),
        click.option("--candidates", "auto_candidates", metavar="M1,M2,...",
                     help="auto: the methods to try.  [default: every candidate: weight, weight-tokens, activation, "
                          "weight+activation]"),
        click.option("--budget", "auto_budget", type=FiniteFloat(0), metavar="SECONDS",
                     help="auto: once this many seconds have gone, skip the candidates not yet run (the first always runs)."),
        click.option("--groups", default=None, help=GROUPS_HELP),
        click.option("--rounds", default=10, show_default=True, type=click.IntRange(0, 10000), help="At most this many rounds of the method's iteration."),
        click.option("--tol", default=1e-6, show_default=True, type=FiniteFloat(0), help="Stop once a round improves the objective by less than this (relative)."),
        click.option("--device", default="cpu", show_default=True, type=DEVICE, help="Where the dense work runs: cpu, cuda or cuda:N."),
        click.option("--steps", "learn_steps", type=STEPS, metavar="N",
                     help="learned: optimisation steps.  [default: 500, or --epochs]"),
        click.option("--epochs", "learn_epochs", type=EPOCHS, metavar="E",
                     help="learned: passes over the train split instead of --steps."),
        click.option("--lr", "learn_lr", type=FiniteFloat(0), help="learned: peak learning rate of AdamW.  [default: 1e-2]"),
        click.option("--lr-scale", "learn_lr_scale", type=LrScale(), metavar="KIND=X[,KIND=X]",
                     help="learned: a factor of --lr per kind of latent (orthogonal, linear, diagonal, rotary, "
                          "permutation), e.g. orthogonal=3,linear=0.3 (docs/learned.md).  [default: 1 for all]"),
        click.option("--batch-size", "learn_batch_size", type=BATCH_SIZE,
                     help="learned: examples per step.  [default: the data's batches]"),
        click.option("--micro-batch", "learn_micro_batch", type=BATCH_SIZE, metavar="N",
                     help="learned: examples per forward pass; a step's batch runs in pieces whose gradients add up "
                          "(a batch that does not fit in memory).  [default: the whole batch]"),
        click.option("--autocast", "learn_autocast", type=click.Choice(["bfloat16", "float16"]),
                     help="learned: the training forward passes in this precision (torch.autocast); the group elements "
                          "stay float32, validation and the function check full precision.  [default: off]"),
        click.option("--average", "learn_average", type=FiniteFloat(0), metavar="BETA",
                     help="learned: also validate an exponential moving average of the latents with this decay "
                          "(e.g. 0.99); the better of it and the iterate can be the result.  [default: off]"),
        click.option("--path-points", "learn_path_points", type=click.IntRange(1, 64), metavar="N",
                     help="learned: lambdas drawn per step, the loss their mean (the path's loss, N times the "
                          "work of a step).  [default: 1]"),
        click.option("--lambda", "learn_lambda", metavar="narrow|uniform|fixed:X",
                     help="learned: where lambda is drawn: narrow U(0.4, 0.6), uniform U(0, 1), or fixed:X.  [default: narrow]"),
        click.option("--permutations", "learn_permutations", type=click.Choice(["frozen", "ste", "sinkhorn"]),
                     help="learned: permutations kept at weight matching's, learned with a straight-through "
                          "estimator, or Sinkhorn soft permutations annealed to hard.  [default: frozen]"),
        click.option("--seed", "learn_seed", type=SEED, help="learned: the seed of batch order and lambdas.  [default: 0]"),
        click.option("--init", "learn_init", metavar="METHOD",
                     help="learned: start from this closed-form method's alignment (auto: the candidate with the "
                          "lowest midpoint loss).  [default: weight]"),
        click.option("--lift-free", "lift_free", type=LIFT_FREE_STEPS, default=0, metavar="N",
                     help="B narrower than A: after aligning, train the lift's free directions (the readers' weights "
                          "off B's residual span, which B never uses) for N steps on the train split of --data, for the "
                          "interpolated model's loss (docs/width.md).  [default: 0, off]"),
        click.option("--model", "factory", metavar="MODEL.py", help="For state-dict checkpoints: the model file whose build() makes their module."),
        click.option("--unfold-norms", "unfold_norms", is_flag=True,
                     help="Write the output with its norms unfolded using A's norm gains (and biases): the norm weights "
                          "are A's and the layers that read them are divided by them (same function), so the output "
                          "compares with A's raw weights; writers stay mean-centred. Without it the output is in "
                          "canonical form (norm gains 1, LayerNorm biases folded into the readers' biases)."),
        click.option("--force", is_flag=True, help="Replace an existing output folder."),
        click.option("--json", "as_json", is_flag=True, help="Print a JSON summary instead of tables."),
    ]
    for o in reversed(opts):
        fn = o(fn)
    return fn


@click.command("match")
@click.argument("model_a", metavar="A")
@click.argument("model_b", metavar="B")
@click.option("--certify", is_flag=True, help="Also bound the objective's global minimum over the searched groups and "
                                                "report the result's gap: a global bound (norm-preserving groups), per-space bounds "
                                                "given the others and a joint bound (exact where the spaces share no parameter, an SDP where they do: "
                                                "the Shor lift on tiny sizes, the Gram relaxation for the residual with "
                                                "a layer's spaces up to n = 64; match.json: certificate; slow).")
@_common_options
@handle_errors
def match_cmd(model_a: str, model_b: str, certify: bool, spec_arg: str | None, out: Path, method: str | None,
              data_arg: str | None, groups: str | None, rounds: int, tol: float, device: str, lift_free: int,
              unfold_norms: bool, factory: str | None, force: bool, as_json: bool, **learn: Any) -> None:
    """Align model B to model A under a spec, with any registered method (default: weight
    matching, data-free; learned matching: --method learned --data SOURCE, with --steps,
    --lr, --lambda, ...).

    A and B: model files, Hugging Face folders, GGUF files (dequantised; written back as a
    Hugging Face folder), or state dicts / safetensors with --model.
    Writes into OUT: B aligned, in B's own format (a Hugging Face folder stays one; a
    checkpoint becomes model.<ext>), its transform record (transform.safetensors and
    transform.json: the group element of every space, to re-apply or invert) and
    match.json (objective per round, time per phase). Exit 0 on success, 2 on bad input.

    Aligned B is written in canonical form: norm gains folded into the layers that read
    them (gains 1), LayerNorm biases folded into their biases, residual writers
    mean-centred. It computes what B computes, but its norm weights differ from A's raw
    ones even when the recovery is exact; --unfold-norms writes it with A's norm gains.
    """
    _quiet_threads()
    check_output(out, force, [model_a, model_b, factory, spec_arg, *data_inputs(data_arg)])
    dev = device
    learned_options(default_method(method, data_arg), learn)  # bad flags fail before any loading
    if certify:
        from symspec.alignment import get_method
        from symspec.alignment.api import no_certificate

        if not get_method(default_method(method, data_arg)).canonical:
            raise _input_error(f"--certify: {no_certificate(default_method(method, data_arg))}")
    with _Progress(True) as progress:
        la, lb, spec = _load_pair(model_a, model_b, factory, spec_arg, progress)
        result = _align(la, lb, spec, method, data_arg, factory, progress, learn, groups=groups, rounds=rounds,
                        tol=tol, device=dev, keep_canonical_b=certify, lift_free=lift_free)
        extra: dict[str, Any] = {"groups": result.record.meta["groups"]}
        if certify:
            progress.phase("certifying")
            extra["certificate"] = result.certify().to_dict()
        progress.phase("writing")
        files: list[str] = []
        lifted = result.info.get("lift")
        aligned = _unfolded(result, result.aligned_b, la, extra) if unfold_norms else result.aligned_b
        data = _loading_notes(_summary("match", model_a, model_b, out, files, result, extra), la, lb)
        # a B lifted to A's widths is written in A's format and config
        publish(out, force, _filler(la if lifted else lb, aligned, result, "match", data, files, (model_a, model_b)))
    if as_json:
        echo_json(data)
    else:
        _print_summary(data)


@click.command("merge")
@click.argument("model_a", metavar="A")
@click.argument("model_b", metavar="B")
@click.option("--alpha", default=0.5, show_default=True, type=FiniteFloat(0, 1), help="Weight of B: (1 - alpha) A + alpha B.")
@click.option("--no-align", "no_align", is_flag=True, help="Interpolate the weights as they are (vanilla averaging): --method none.")
@_common_options
@handle_errors
def merge_cmd(model_a: str, model_b: str, alpha: float, no_align: bool, spec_arg: str | None, out: Path,
              method: str | None,
              data_arg: str | None, groups: str | None, rounds: int, tol: float, device: str, lift_free: int,
              unfold_norms: bool, factory: str | None, force: bool, as_json: bool, **learn: Any) -> None:
    """Write the interpolation (1 - alpha) A + alpha B, with B aligned to A first.

    The merged model keeps A's class and format; aligned, it is in canonical form (norm
    gains folded into the layers that read them: same function, same class). With
    --no-align (--method none), the raw weights are averaged and no spec is needed. Exit
    0 on success, 2 on bad input.
    """
    _quiet_threads()
    from symspec.alignment import get_method
    from symspec.statedict import check_finite, interpolate_state_dicts

    check_output(out, force, [model_a, model_b, factory, spec_arg, *data_inputs(data_arg)])
    dev = device
    method = "none" if no_align else default_method(method, data_arg)
    learned_options(method, learn)  # bad flags fail before any loading
    # a method that does not use canonical forms (vanilla averaging) merges the raw weights
    no_align = not get_method(method).canonical
    with _Progress(True) as progress:
        if no_align:
            from symspec.loading import load_model

            progress.phase("loading")
            la = load_model(model_a, factory=factory)
            lb = load_model(model_b, factory=factory)
            if type(la.model) is not type(lb.model):
                raise _input_error(f"A is a {type(la.model).__name__} but B is a {type(lb.model).__name__}")
            sa = {k: v.detach() for k, v in la.model.state_dict().items()}
            sb = {k: v.detach() for k, v in lb.model.state_dict().items()}
            bad = [k for k in sa if k not in sb or sa[k].shape != sb[k].shape]
            if bad or set(sb) - set(sa):
                raise _input_error(f"A and B do not have the same parameters: {', '.join((bad or sorted(set(sb) - set(sa)))[:5])}")
            # same shapes do not make the same function (another head count, epsilon, rotary base)
            warning = config_warning(la, lb, ("A", "B"), "average")
            if warning:
                click.echo(warning, err=True)
            check_finite(sa, "A")
            check_finite(sb, "B")
            merged = interpolate_state_dicts(sa, sb, alpha)
            result = None
        else:
            la, lb, spec = _load_pair(model_a, model_b, factory, spec_arg, progress)
            result = _align(la, lb, spec, method, data_arg, factory, progress, learn, groups=groups, rounds=rounds,
                            tol=tol, device=dev, lift_free=lift_free)
            merged = result.interpolate(alpha)
        progress.phase("writing")
        files: list[str] = []
        extra = {"groups": result.record.meta["groups"]} if result is not None else {"method": "none"}
        if unfold_norms:
            merged = _unfolded(result, merged, la, extra)
        data = _loading_notes(_summary("merge", model_a, model_b, out, files, result,
                                       {"alpha": alpha, "aligned": not no_align, **extra}), la, lb)

        publish(out, force, _filler(la, merged, result, "merge", data, files, (model_a, model_b)))
    if as_json:
        echo_json(data)
    else:
        _print_summary(data)


def _unfolded(result: Any, weights: Any, la: Any, extra: dict[str, Any]) -> Any:
    """--unfold-norms: ``weights`` with their norms unfolded using A's gains and biases
    (:func:`symspec.transforms.unfold_norms`); its notes go to stderr and, with the norms
    unfolded, into the summary (``extra["unfold_norms"]``)."""
    from symspec.alignment import get_method

    if result is None or not (get_method(result.method).canonical or "lift" in result.info):
        u = None
        notes = [f"the method '{result.method if result is not None else 'none'}' works on the raw weights: "
                 "no norm was folded, nothing to unfold"]
    else:
        from symspec.transforms import unfold_norms

        u = unfold_norms(result.bound, weights, {k: v.detach() for k, v in la.model.state_dict().items()})
        notes = u.notes
    for note in notes:
        click.echo(f"note: --unfold-norms: {note}", err=True)
    extra["unfold_norms"] = {"unfolded": u.unfolded if u is not None else [], "notes": notes}
    return u.state_dict if u is not None else weights


def _filler(loaded: Any, weights: Any, result: Any, summary: str, data: dict[str, Any], files: list[str],
            names: tuple[str, str]) -> Callable[[Path], None]:
    """What fills the output folder: the model, the transform record (when aligned) and
    the summary ``{summary}.json``, each file named in ``files`` (which ``data`` lists)."""

    def fill(folder: Path) -> None:
        from symspec.outputs import atomic_write_text

        files.extend(write_model(loaded, weights, folder))
        if result is not None:
            result.record.meta.update({"a": names[0], "b": names[1]})
            result.record.save(folder)
            files.extend(["transform.safetensors", "transform.json"])
        files.append(f"{summary}.json")
        atomic_write_text(folder / f"{summary}.json", _json(data) + "\n")

    return fill


def _json(data: Any) -> str:
    import json

    return json.dumps(data, indent=2, default=str)
