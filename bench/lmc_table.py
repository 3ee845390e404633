"""The paper's Table 2, reproduced in shape on models trained here.

For each task (a character GPT on Tiny Shakespeare, a small ViT on MNIST) it trains
independent pairs (distinct seeds; cached, see bench/trained.py), aligns each pair with
every method symspec has, and measures the loss barrier of the linear path on the test
split (11 points of λ). It prints and writes:

- a table like the paper's: barrier mean ± standard error per method and task, the
  endpoints' test loss and accuracy, and the wall time of each matching;
- a plot of the curves per task (bench/results/lmc_table_<task>.png);
- JSON results (bench/results/lmc_table.json; ``--quick`` writes lmc_table_quick.json);
- with ``--readme``, the markdown table into README.md between the
  ``<!-- lmc-table -->`` markers, next to the command that made it.

Full mode (3 pairs per task, about an hour on 2 cores, most of it training the first
time): ``python -m bench.lmc_table --readme``. Smoke test: ``python -m bench.lmc_table
--quick`` (tiny models, one pair, a few seconds).

Methods are the registered alignment methods (``symspec.alignment.method_names()``):
vanilla averaging, weight matching with permutations only, weight matching with the
full groups, universe matching, and whatever else is registered when the benchmark runs
(data-driven methods align on the train split; learned matching runs 500 steps of 64
sequences or images and picks its step on the val split); ``--methods`` picks some. The ablation ``weight-perm-resid-fixed`` (permutations of heads and units,
the residual stream left as it is) runs only when named:
``python -m bench.lmc_table --tasks vit --methods none,weight-perm,weight-perm-resid-fixed,weight
--out bench/results/lmc_ablation.json --results bench/results/ablation``.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import shlex
import sys
import time
from pathlib import Path
from typing import Any

import torch

from bench import trained
from bench.fixtures import RESULTS, ROOT
from symspec import __version__
from symspec.alignment import get_method, method_names, register_method
from symspec.alignment.builtin import WeightMatching
from symspec.analyzers.barrier import (
    PairResult,
    mean_stderr,
    measure,
    method_label,
    summarize,
)
from symspec.analyzers.plots import plot_results
from symspec.learned import LearnedMatching, LearnedOptions
from symspec.outputs import atomic_write_text
from symspec.universe import universe_match

# An ablation (both task specs name their residual stream ``resid``): permutations of
# heads and units only, the residual stream left as it is.
register_method(WeightMatching(name="weight-perm-resid-fixed", label="permutations only, residual fixed",
                               groups="perm,resid=fixed", candidate=False), replace=True)
#: methods run only when asked for with --methods
ABLATIONS = ("weight-perm-resid-fixed",)

RESULTS = RESULTS
#: table order; methods registered later come after these
ORDER = ("none", "weight-perm", "weight", "universe")
TASKS = {"gpt": "nanogpt", "vit": "vit"}
README_BEGIN = "<!-- lmc-table:begin -->"
README_END = "<!-- lmc-table:end -->"
#: learned matching's steps per pair (full run, --quick)
LEARNED_STEPS = {False: 500, True: 20}


def _pm(mean: float, se: float | None, digits: int = 2) -> str:
    if not math.isfinite(mean):
        return str(mean)
    return f"{mean:.{digits}f} ± {se:.{digits}f}" if se is not None else f"{mean:.{digits}f}"


def task_label(task: str, data: str) -> str:
    kind, _, arg = data.partition(":")
    if task == "gpt":
        name = "Tiny Shakespeare" if Path(arg).name == "tinyshakespeare.txt" else Path(arg).name
        return f"{name} GPT"
    return ("MNIST" if kind == "mnist" else kind) + " ViT"


def learned_options(method: LearnedMatching, quick: bool) -> LearnedOptions:
    """Learned matching's settings here: batches of 64 examples, the default rate."""
    return LearnedOptions(steps=LEARNED_STEPS[quick], batch_size=64, permutations=method.permutations)


def run_task(task: str, data: str, pairs: int, methods: list[str], points: int, quick: bool, log: Any,
             cache: Path) -> dict[str, Any]:
    recipe_name = f"{task}-quick" if quick else task
    seeds = list(range(2 * pairs))
    label = task_label(task, data)
    log(f"{label}: {len(seeds)} models ({recipe_name} recipe, data {data})")
    models = trained.trained_models(recipe_name, seeds, data, log=log, cache=cache)
    spec = TASKS[task]
    recipe = trained.RECIPES[recipe_name]
    test = trained.split(recipe_name, data, recipe, models[0][0], "test", batch=512)
    model_pairs = [(models[2 * i][0], models[2 * i + 1][0]) for i in range(pairs)]
    names = [(f"seed{2 * i}", f"seed{2 * i + 1}") for i in range(pairs)]
    start = time.perf_counter()
    train = (trained.split(recipe_name, data, recipe, models[0][0], "train", batch=512)
             if any(get_method(m).needs_data for m in methods) else None)
    # learned matching picks its step on the val split (the barrier is measured on test)
    val = (trained.split(recipe_name, data, recipe, models[0][0], "val", batch=512)
           if any(getattr(get_method(m), "validates", False) for m in methods) else None)
    align_kw = {m: {"options": learned_options(get_method(m), quick)} for m in methods
                if isinstance(get_method(m), LearnedMatching)}
    results = measure(model_pairs, test, methods=methods, spec=spec, points=points, names=names, align_data=train,
                      align_validation=val, align_kw=align_kw)
    seconds = time.perf_counter() - start
    endpoints = []
    for model, meta in models:
        loss, acc = trained.evaluate(model, test)
        endpoints.append({"seed": meta["seed"], "test_loss": loss, "test_accuracy": acc,
                          "train_seconds": meta["train_seconds"], "cached": meta["cached"]})
    return {"task": task, "label": label, "spec": spec, "data": data, "recipe": recipe_name,
            "test": test.describe(), "endpoints": endpoints, "results": results, "seconds": seconds,
            "merge": (merge_all([m for m, _ in models], spec, test, log,
                                learned=(train, val, learned_options(get_method("learned"), quick)) if "learned" in methods else None)
                      if "universe" in methods else None)}


def merge_all(models: list[torch.nn.Module], spec: str, test: Any, log: Any,
              learned: tuple[Any, Any, LearnedOptions] | None = None) -> dict[str, Any]:
    """Merge every model of a task into one: plain averaging vs universe matching (and,
    with ``learned`` = (train, val, options), universe matching with the learned
    refinement)."""
    import copy

    log(f"  merging all {len(models)} models: plain averaging and universe matching"
        + (" (and its learned refinement)" if learned else ""))
    states = [{k: v.detach() for k, v in m.state_dict().items()} for m in models]
    plain = copy.deepcopy(models[0])
    plain.load_state_dict({k: sum(sd[k] for sd in states) / len(states) for k in states[0]})
    plain_loss, plain_acc = trained.evaluate(plain, test)
    start = time.perf_counter()
    res = universe_match(models, spec)
    seconds = time.perf_counter() - start
    merged = res.canonical_model
    merged.load_state_dict(res.merged)
    uni_loss, uni_acc = trained.evaluate(merged, test)
    out = {"models": len(models), "plain_loss": plain_loss, "plain_accuracy": plain_acc,
           "universe_loss": uni_loss, "universe_accuracy": uni_acc, "universe_seconds": seconds,
           "universe_rounds": len(res.rounds), "objective": res.history}
    if learned is not None:
        train, val, opts = learned
        start = time.perf_counter()
        res = universe_match(models, spec, method="learned", data=train, validation=val, options=opts)
        out["learned_seconds"] = time.perf_counter() - start
        merged = res.canonical_model
        merged.load_state_dict(res.merged)
        out["learned_loss"], out["learned_accuracy"] = trained.evaluate(merged, test)
        out["refinement"] = {k: res.refinement[k] for k in ("steps", "best_step", "history", "alpha")}
    return out


def summary_rows(run: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    for method, rs in run["results"].items():
        s = summarize(rs)
        align = [r.align_seconds for r in rs]
        rows.append({
            "method": method, "label": method_label(method), "pairs": s.n,
            "barrier_mean": s.barrier_mean, "barrier_stderr": s.barrier_stderr, "peak_lambda_mean": s.peak_lambda_mean,
            "accuracy_barrier_mean": s.accuracy_barrier_mean, "accuracy_barrier_stderr": s.accuracy_barrier_stderr,
            "align_seconds_mean": sum(align) / len(align),
            "loss_curve_mean": list(s.loss_mean), "lambdas": list(rs[0].curve.lambdas),
            "pairs_detail": [_pair(r) for r in rs],
        })
    return rows


def _pair(r: PairResult) -> dict[str, Any]:
    return {"a": r.a, "b": r.b, "barrier": r.barrier.value, "peak_lambda": r.barrier.peak_lambda,
            "loss_a": r.curve.loss_a, "loss_b": r.curve.loss_b, "losses": list(r.curve.losses),
            "accuracies": list(r.curve.accuracies) if r.curve.accuracies is not None else None,
            "align_seconds": r.align_seconds, "objective": r.align_info.get("objective") if r.align_info else None,
            **({"auto": auto} if (auto := ((r.align_info or {}).get("info") or {}).get("auto")) else {})}


def auto_choices(runs: list[dict[str, Any]]) -> list[str]:
    """One line per task where ``auto`` ran: the method it chose for each pair."""
    lines = []
    for run in runs:
        row = next((r for r in run["rows"] if r["method"] == "auto"), None)
        if row is not None:
            won = [p["auto"]["winner"] for p in row["pairs_detail"] if "auto" in p]
            lines.append(f"- {run['label']}: auto chose " + ", ".join(f"{w} (pair {i + 1})" for i, w in enumerate(won)))
    return lines


def markdown(runs: list[dict[str, Any]], command: str) -> str:
    labels = [run["label"] for run in runs]
    found = list(dict.fromkeys(r["method"] for run in runs for r in run["rows"]))
    methods = [m for m in ORDER if m in found] + [m for m in found if m not in ORDER]
    head = [f"{lab} {kind}" for lab in labels for kind in ("loss barrier", "accuracy barrier")]
    lines = ["| method | " + " | ".join(head) + " | " + " | ".join(f"{lab} matching time" for lab in labels) + " |",
             "|---|" + "---:|" * (3 * len(labels))]
    by_task = {run["label"]: {r["method"]: r for r in run["rows"]} for run in runs}
    for m in methods:
        cells, times = [], []
        for lab in labels:
            r = by_task[lab].get(m)
            cells.append(_pm(r["barrier_mean"], r["barrier_stderr"]) if r else "n/a")
            acc = r.get("accuracy_barrier_mean") if r else None
            cells.append(_pm(acc, r.get("accuracy_barrier_stderr"), 3) if r and acc is not None else "n/a")
            times.append(f"{r['align_seconds_mean']:.2f} s" if r and m != "none" else "–")
        lines.append(f"| {method_label(m)} | " + " | ".join(cells) + " | " + " | ".join(times) + " |")
    choices = auto_choices(runs)
    if choices:
        lines += ["", *choices]
    lines.append("")
    lines.append("| task | models | test loss (mean ± se) | test accuracy (mean ± se) |")
    lines.append("|---|---:|---:|---:|")
    for run in runs:
        lm, ls = mean_stderr([e["test_loss"] for e in run["endpoints"]])
        am, as_ = mean_stderr([e["test_accuracy"] for e in run["endpoints"]])
        lines.append(f"| {run['label']} | {len(run['endpoints'])} | {_pm(lm, ls, 3)} | {_pm(am, as_, 3)} |")
    merges = [run for run in runs if run.get("merge")]
    if merges:
        lines.append("")
        refined = all("learned_loss" in run["merge"] for run in merges)
        lines.append("| task | all models merged into one | endpoints' test loss / accuracy | plain averaging | universe matching | universe matching time |"
                     + (" universe matching + learned refinement | its time |" if refined else ""))
        lines.append("|---|---:|---:|---:|---:|---:|" + ("---:|---:|" if refined else ""))
        for run in merges:
            mg = run["merge"]
            lm, _ = mean_stderr([e["test_loss"] for e in run["endpoints"]])
            am, _ = mean_stderr([e["test_accuracy"] for e in run["endpoints"]])
            lines.append(f"| {run['label']} | {mg['models']} | {lm:.3f} / {am:.3f} | {mg['plain_loss']:.3f} / {mg['plain_accuracy']:.3f} | "
                         f"{mg['universe_loss']:.3f} / {mg['universe_accuracy']:.3f} | {mg['universe_seconds']:.1f} s |"
                         + (f" {mg['learned_loss']:.3f} / {mg['learned_accuracy']:.3f} | {mg['learned_seconds']:.1f} s |"
                            if refined else ""))
    pairs = {len(run["rows"][0]["pairs_detail"]) for run in runs}
    lines.append("")
    points = {len(run["rows"][0]["lambdas"]) for run in runs}
    lines.append(f"Loss and accuracy barriers on the test split, {'/'.join(map(str, sorted(points)))} points of λ, mean ± standard error "
                 f"over {'/'.join(map(str, sorted(pairs)))} pair(s) of independently trained models (the accuracy barrier is the "
                 f"largest drop of accuracy below the endpoints' line); merged models as test loss / accuracy; matching time per "
                 f"pair on {torch.get_num_threads()} CPU thread(s). "
                 f"Generated by `{command}`.")
    return "\n".join(lines) + "\n"


def update_readme(text: str, path: Path = ROOT / "README.md") -> None:
    readme = path.read_text()
    if README_BEGIN not in readme or README_END not in readme:
        raise SystemExit(f"{path} has no {README_BEGIN} ... {README_END} markers")
    head, _, rest = readme.partition(README_BEGIN)
    _, _, tail = rest.partition(README_END)
    atomic_write_text(path, head + README_BEGIN + "\n" + text + README_END + tail)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="tiny models, one pair: a smoke test")
    p.add_argument("--pairs", type=int, help="pairs per task (default 3; 1 with --quick)")
    p.add_argument("--tasks", default="gpt,vit", help="comma-separated: gpt, vit")
    p.add_argument("--text", help="text:PATH for the GPT task (default: ../shared/data/tinyshakespeare.txt)")
    p.add_argument("--images", help="mnist:DIR or digits for the ViT task (default: ../shared/data/mnist; digits with --quick)")
    p.add_argument("--methods", help=f"comma-separated methods (default: every registered one; known: {', '.join(method_names())})")
    p.add_argument("--points", type=int, default=11)
    p.add_argument("--out", type=Path, help="JSON results (default bench/results/lmc_table[_quick].json)")
    p.add_argument("--readme", action="store_true", help="write the markdown table into README.md")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--cache", type=Path, default=trained.CACHE, help="where trained checkpoints are kept")
    p.add_argument("--results", type=Path, default=RESULTS, help="where plots (and the default JSON) go")
    args = p.parse_args(argv)

    torch.set_num_threads(args.threads)
    pairs = args.pairs or (1 if args.quick else 3)
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    unknown = [t for t in tasks if t not in TASKS]
    if unknown:
        raise SystemExit(f"unknown task {unknown[0]}; tasks: {', '.join(TASKS)}")
    methods = ([m.strip() for m in args.methods.split(",")] if args.methods else
               [m for m in ORDER if m in method_names()]
               + [m for m in method_names() if m not in ORDER and m not in ABLATIONS])
    for m in methods:
        if m not in method_names():
            raise SystemExit(f"unknown method {m}; known: {', '.join(method_names())}")
    text = args.text or f"text:{trained.DEFAULT_TEXT}"
    images = args.images or ("digits" if args.quick else f"mnist:{trained.DEFAULT_MNIST}")
    for task, src in (("gpt", text), ("vit", images)):
        if task in tasks and src.startswith(("text:", "mnist:")) and not Path(src.partition(":")[2]).exists():
            raise SystemExit(f"{src.partition(':')[2]} is missing (../shared/data is absent?); pass --text/--images")

    def log(msg: str) -> None:
        print(msg, flush=True)

    runs = []
    for task in tasks:
        run = run_task(task, text if task == "gpt" else images, pairs, methods, args.points, args.quick, log, args.cache)
        run["rows"] = summary_rows(run)
        args.results.mkdir(parents=True, exist_ok=True)
        suffix = "_quick" if args.quick else ""
        plot = args.results / f"lmc_table_{task}{suffix}.png"
        plot_results(run["results"], plot, title=f"{run['label']}: loss along (1-λ)A + λB, test split")
        run["plot"] = str(plot.relative_to(ROOT) if plot.is_relative_to(ROOT) else plot)
        runs.append(run)

    # the command that made these numbers (--readme only says where the table goes)
    given = [a for a in (argv if argv is not None else sys.argv[1:]) if a != "--readme"]
    command = shlex.join(["python", "-m", "bench.lmc_table", *given])
    table = markdown(runs, command)
    print()
    print(table)
    doc = {
        "schema": "symspec.lmc_table/1", "symspec_version": __version__, "command": command, "quick": args.quick,
        "machine": {"python": platform.python_version(), "torch": torch.__version__, "threads": torch.get_num_threads(),
                    "processor": platform.processor() or platform.machine()},
        "tasks": [{k: v for k, v in run.items() if k != "results"} for run in runs],
        "markdown": table,
    }
    out = args.out or args.results / ("lmc_table_quick.json" if args.quick else "lmc_table.json")
    atomic_write_text(out, json.dumps(doc, indent=2, default=str) + "\n")
    print(f"wrote {out.relative_to(ROOT) if out.is_relative_to(ROOT) else out}")
    if args.readme:
        update_readme(table)
        print("updated README.md")
    return doc


if __name__ == "__main__":
    main()
