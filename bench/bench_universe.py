"""Universe matching on independently trained models: the merged model's test loss
against the endpoints, plain averaging and one-reference alignment.

    python -m bench.bench_universe [--task gpt|vit] [--seeds 0 1 2] [--rounds 10] [--jobs 1]
                                   [--method weight] [--quick] [--out bench/results/universe.json]

The models are the paper-table benchmark's (bench/trained.py: same recipes, same cache
under bench/cache/, trained there when missing). For N models (N >= 3) it measures, on
the test split:

- the endpoints' losses (mean ± standard error);
- vanilla averaging: the mean of the weights as trained;
- one-reference alignment: every model aligned to the first (by weight matching, or the
  registered data-free ``--method``), then averaged (universe matching stopped after its
  first round);
- universe matching: rounds until the objective stops improving (``--rounds``, ``--tol``);
- for three models, the deviation L(Σ wᵢθᵢ) - Σ wᵢL(θᵢ) over the simplex (grid of 1/6)
  for vanilla averaging and universe matching, and a heat map
  (bench/results/universe_<task>.png);

with the matching's objective per round and its wall time. Results go to
bench/results/universe.json (``--quick``: universe_quick.json), with a markdown table.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time
from pathlib import Path
from typing import Any

import torch

from bench import trained
from bench.fixtures import RESULTS, ROOT
from symspec import __version__
from symspec.alignment import get_method
from symspec.analyzers.barrier import mean_stderr
from symspec.analyzers.simplex import analyze_merge, plot_simplex
from symspec.outputs import atomic_write_text
from symspec.universe import universe_match

RESULTS = RESULTS
SPECS = {"gpt": "nanogpt", "vit": "vit"}


def _state(m: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach() for k, v in m.state_dict().items()}


def _pm(mean: float, se: float | None, digits: int = 3) -> str:
    return f"{mean:.{digits}f} ± {se:.{digits}f}" if se is not None else f"{mean:.{digits}f}"


def run(task: str, seeds: list[int], data: str, *, rounds: int, tol: float, jobs: int | None, quick: bool,
        resolution: int, log: Any, cache: Path, method: str = "weight") -> dict[str, Any]:
    recipe_name = f"{task}-quick" if quick else task
    recipe = trained.RECIPES[recipe_name]
    models = [m for m, _ in trained.trained_models(recipe_name, seeds, data, log=log, cache=cache)]
    names = [f"seed{s}" for s in seeds]
    spec = SPECS[task]
    test = trained.split(recipe_name, data, recipe, models[0], "test", batch=512)

    log(f"{task}: one-reference alignment (1 round) of {len(models)} models")
    t0 = time.perf_counter()
    one = universe_match(models, spec, rounds=1, jobs=jobs, method=method)
    one_seconds = time.perf_counter() - t0
    log(f"{task}: universe matching (at most {rounds} rounds, tol {tol})")
    t0 = time.perf_counter()
    uni = universe_match(models, spec, rounds=rounds, tol=tol, jobs=jobs, method=method,
                         progress=lambda e: log(f"  round {e.round}: objective {e.objective:.6g} ({e.seconds:.1f} s)")
                         if e.kind == "round" else None)
    uni_seconds = time.perf_counter() - t0
    assert uni.canonical_model is not None and one.canonical_model is not None

    log(f"{task}: evaluating on the test split ({test.examples} examples)")
    analysis = analyze_merge(module=models[0], canonical_module=uni.canonical_model, n=len(models), names=names,
                             load_raw=lambda i: _state(models[i]), load_aligned=uni.aligned_state, merged=uni.merged,
                             data=test, simplex=len(models) == 3, resolution=resolution)
    from symspec.analyzers.interpolate import PathEvaluator

    one_loss = PathEvaluator(one.canonical_model, test).evaluate(one.merged)
    ends = [e.loss for e in analysis.endpoints]
    accs = [e.accuracy for e in analysis.endpoints if e.accuracy is not None]
    lm, ls = mean_stderr(ends)
    am, as_ = mean_stderr(accs) if len(accs) == len(ends) else (math.nan, None)
    rows = [
        {"method": "endpoints", "label": f"endpoints (mean ± se of {len(ends)})", "loss": lm, "loss_stderr": ls,
         "accuracy": am, "accuracy_stderr": as_, "seconds": None},
        {"method": "none", "label": "vanilla averaging", "loss": analysis.plain.loss, "accuracy": analysis.plain.accuracy,
         "seconds": 0.0},
        {"method": "reference", "label": f"{get_method(method).label} to seed 0, averaged (1 round)", "loss": one_loss.loss,
         "accuracy": one_loss.accuracy, "seconds": one_seconds},
        {"method": "universe", "label": f"universe matching ({len(uni.rounds)} rounds)", "loss": analysis.merged.loss,
         "accuracy": analysis.merged.accuracy, "seconds": uni_seconds},
    ]
    out: dict[str, Any] = {
        "task": task, "spec": spec, "recipe": recipe_name, "data": data, "test": test.describe(), "seeds": seeds,
        "rows": rows, "analysis": analysis.to_dict(), "universe": uni.summary(), "one_round": one.summary(),
    }
    if analysis.surfaces:
        plot = RESULTS / f"universe_{task}{'_quick' if quick else ''}.png"
        plot_simplex(analysis.surfaces, plot, title=f"{task}, test split: L(Σ wᵢθᵢ) − Σ wᵢL(θᵢ); black: 0")
        out["plot"] = str(plot.relative_to(ROOT))
    return out


def markdown(result: dict[str, Any], command: str) -> str:
    lines = ["| method | test loss | test accuracy | loss − endpoints' mean | time |", "|---|---:|---:|---:|---:|"]
    mean = result["rows"][0]["loss"]
    for r in result["rows"]:
        loss = _pm(r["loss"], r.get("loss_stderr")) if r["method"] == "endpoints" else f"{r['loss']:.3f}"
        acc = "n/a" if r["accuracy"] is None or (isinstance(r["accuracy"], float) and math.isnan(r["accuracy"])) else (
            _pm(r["accuracy"], r.get("accuracy_stderr")) if r["method"] == "endpoints" else f"{r['accuracy']:.3f}")
        gap = "0" if r["method"] == "endpoints" else f"{r['loss'] - mean:+.3f}"
        secs = "–" if not r["seconds"] else f"{r['seconds']:.1f} s"
        lines.append(f"| {r['label']} | {loss} | {acc} | {gap} | {secs} |")
    simplex = result["analysis"]["simplex"]
    if simplex:
        lines.append("")
        lines.append("Max deviation over the simplex (grid of 1/{}): ".format(simplex[0]["resolution"])
                     + ", ".join(f"{s['label']} {s['max_deviation']:.3f}" for s in simplex) + ".")
    lines.append("")
    lines.append(f"{result['task']} ({result['recipe']} recipe), seeds {result['seeds']}, test split; "
                 f"generated by `{command}`.")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--task", choices=sorted(SPECS), default="gpt")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--data", help="text:PATH (gpt) or mnist:DIR / digits (vit); default: ../shared/data")
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--tol", type=float, default=1e-4)
    p.add_argument("--jobs", type=int, default=None, help="worker processes for the alignments (default: this process)")
    p.add_argument("--method", default="weight", help="the registered alignment method of every round (default: weight)")
    p.add_argument("--resolution", type=int, default=6, help="simplex grid step 1/K (three models)")
    p.add_argument("--quick", action="store_true", help="tiny models (the benchmark's quick recipe): a smoke test")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--cache", type=Path, default=trained.CACHE)
    p.add_argument("--out", type=Path, help="default bench/results/universe[_quick].json")
    args = p.parse_args(argv)
    if len(args.seeds) < 2:
        raise SystemExit("universe matching needs at least 2 seeds")
    torch.set_num_threads(args.threads)
    data = args.data or (f"text:{trained.DEFAULT_TEXT}" if args.task == "gpt" else
                         ("digits" if args.quick else f"mnist:{trained.DEFAULT_MNIST}"))
    if data.startswith(("text:", "mnist:")) and not Path(data.partition(":")[2]).exists():
        raise SystemExit(f"{data.partition(':')[2]} is missing (../shared/data is absent?); pass --data")

    def log(msg: str) -> None:
        print(msg, flush=True)

    started = time.perf_counter()
    result = run(args.task, args.seeds, data, rounds=args.rounds, tol=args.tol, jobs=args.jobs, quick=args.quick,
                 resolution=args.resolution, log=log, cache=args.cache, method=args.method)
    command = "python -m bench.bench_universe " + " ".join(argv if argv is not None else sys.argv[1:])
    table = markdown(result, command.strip())
    doc = {
        "schema": "symspec.bench.universe/1",
        "command": command.strip(),
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "symspec_version": __version__,
        "machine": {"platform": platform.platform(), "python": platform.python_version(), "torch": torch.__version__,
                    "torch_threads": torch.get_num_threads()},
        "seconds": time.perf_counter() - started,
        "markdown": table,
        **result,
    }
    out = args.out or RESULTS / f"universe{'_quick' if args.quick else ''}.json"
    atomic_write_text(out, json.dumps(doc, indent=2, default=str) + "\n")
    print(table)
    print(f"wrote {out.relative_to(ROOT) if out.is_relative_to(ROOT) else out}")
    return doc


if __name__ == "__main__":
    main()
