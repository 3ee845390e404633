"""Models of different widths (the paper's Fig. 3c, on the data here): the loss barrier
between a character GPT of width d and GPTs of width d/8, d/4, d/2 (same depth), per
method, mean ± standard error over seeds.

    python -m bench.bench_width [--ratios 0.125,0.25,0.5] [--seeds 0 1 2] [--methods none,weight,learned]
                                [--points 11] [--train-only] [--out bench/results/width.json]

The wide models are bench/trained.py's ``gpt`` recipe (d 64, 4 heads, 2 layers, Tiny
Shakespeare); the narrow ones the same recipe at d·ratio with 4 heads (narrower heads),
trained by this script on first use and cached like every trained model. Pair k is wide
seed k and narrow seed 100 + k (independent trainings). Methods:

- ``none``: vanilla averaging after a *random* lift of B (Stiefel residual, random unit
  and head copies), the paper's baseline;
- ``weight``: the *fitted* lift (symspec.width.fitted_lift), then weight matching;
- ``random-weight``: a random lift, then weight matching (what fitting the lift adds);
- ``activation-lift``: the lift fitted on activations (``lift="activation"``, the train
  split), then weight matching (what fitting on data rather than weights adds);
- ``activation``: the lift fitted on activations, then activation matching (train split);
- ``learned``: the fitted lift, weight matching, then learned matching (bench/lmc_table.py's
  settings);
- ``weight-free``, ``learned-free``: ``weight``/``learned``, then the lift's free directions
  (the readers' weights off B's residual span, symspec.width.free) trained for the loss
  along the path (lambda drawn by ``--free-lambda``, default U(0, 1)) on the train split
  for ``--steps`` steps (``align(lift_free=..., lift_free_lambda=...)``).

The barrier is measured on the test split; learned matching trains on the train split
and picks its step on val. Results go to ``--out`` with the command that made them.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from bench import trained
from bench.fixtures import RESULTS, command_line, write_results
from symspec.analyzers.barrier import Measurer, align_pair, mean_stderr, pair_result

METHODS = {"none": ("none", "random"), "random-weight": ("weight", "random"), "weight": ("weight", "fitted"),
           "activation-lift": ("weight", "activation"), "activation": ("activation", "activation"),
           "learned": ("learned", "fitted"), "weight-free": ("weight", "fitted"), "learned-free": ("learned", "fitted")}


def recipe(ratio: float) -> dict[str, Any]:
    base = trained.RECIPES["gpt"]
    d = round(base["model"]["n_embd"] * ratio)
    return {**base, "model": {**base["model"], "n_embd": d, "n_head": 4}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ratios", default="0.125,0.25,0.5")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--methods", default="none,random-weight,weight,activation-lift,activation,learned")
    ap.add_argument("--points", type=int, default=11)
    ap.add_argument("--steps", type=int, default=300, help="learned matching's steps, and the free directions' (-free methods)")
    ap.add_argument("--free-lambda", default="uniform", help="-free methods: where lambda is drawn (uniform, narrow, fixed:X)")
    ap.add_argument("--data", default=f"text:{trained.DEFAULT_TEXT}")
    ap.add_argument("--train-only", action="store_true")
    ap.add_argument("--out", default=str(RESULTS / "width.json"))
    ap.add_argument("--plot", default=str(RESULTS / "width.png"), help="the figure (barrier vs width ratio)")
    ap.add_argument("--from-results", action="store_true", help="only draw the figure and table from --out")
    args = ap.parse_args(argv)
    if args.from_results:
        import json

        doc = json.loads(Path(args.out).read_text())
        plot(doc["rows"], Path(args.plot))
        return 0
    ratios = [float(r) for r in args.ratios.split(",")]
    methods = args.methods.split(",")
    wide = trained.trained_models("gpt", args.seeds, args.data)
    narrow = {r: trained.trained_models("gpt", [100 + s for s in args.seeds], args.data, recipe=recipe(r)) for r in ratios}
    if args.train_only:
        return 0
    from symspec.learned.method import LearnedOptions

    rec = trained.RECIPES["gpt"]
    test = trained.split("gpt", args.data, rec, wide[0][0], "test", batch=512)
    train = trained.split("gpt", args.data, rec, wide[0][0], "train", batch=512)
    val = trained.split("gpt", args.data, rec, wide[0][0], "val", batch=512)
    measurer = Measurer(test, points=args.points)
    rows: list[dict[str, Any]] = []
    for r in ratios:
        for meth in methods:
            method, how = METHODS[meth]
            barriers = []
            for k, ((a, _), (b, _)) in enumerate(zip(wide, narrow[r])):
                start = time.perf_counter()
                kw: dict[str, Any] = {"lift": how, "lift_seed": k}
                if method == "learned":
                    kw.update(options=LearnedOptions(steps=args.steps, batch_size=64), validation=val)
                if meth.endswith("-free"):
                    kw.update(lift_free=args.steps, lift_free_lambda=args.free_lambda, validation=val)
                uses_data = method in ("learned", "activation") or how == "activation" or meth.endswith("-free")
                aligned = align_pair(method, a, b, spec="nanogpt", data=train if uses_data else None, **kw)
                curve = measurer.evaluator(aligned.module).curve(aligned.sd_a, aligned.sd_b, measurer.grid, None,
                                                                 (f"d seed {args.seeds[k]}", f"d*{r} seed {100 + args.seeds[k]}"))
                res = pair_result(method, k, "A", "B", curve, aligned.seconds, aligned.info)
                barriers.append(res.barrier.value)
                print(f"ratio {r:<6} {meth:<14} pair {k}: loss barrier {res.barrier.value:.3f} "
                      f"({time.perf_counter() - start:.0f} s)", flush=True)
            mean, se = mean_stderr(barriers)
            rows.append({"ratio": r, "method": meth, "barrier_mean": mean, "barrier_se": se, "barriers": barriers})
    write_results(Path(args.out), {
        "benchmark": "loss barrier between models of different widths (Fig. 3c)",
        "command": command_line(__file__, argv),
        "wide": {"recipe": rec, "seeds": args.seeds},
        "narrow": {str(r): recipe(r)["model"] for r in ratios},
        "rows": rows,
    })
    plot(rows, Path(args.plot))
    print("| ratio | " + " | ".join(methods) + " |")
    print("|---|" + "---|" * len(methods))
    for r in ratios:
        cells = []
        for meth in methods:
            row = next(x for x in rows if x["ratio"] == r and x["method"] == meth)
            cells.append(f"{row['barrier_mean']:.2f} ± {row['barrier_se'] or 0:.2f}")
        print(f"| {r} | " + " | ".join(cells) + " |")
    return 0


LABELS = {"none": "vanilla (random lift)", "random-weight": "random lift + weight matching",
          "weight": "fitted lift + weight matching", "activation-lift": "activation-fitted lift + weight matching",
          "activation": "activation-fitted lift + activation matching", "learned": "fitted lift + learned matching",
          "weight-free": "fitted lift + weight matching + learned free directions",
          "learned-free": "fitted lift + learned matching + learned free directions"}


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    """Loss barrier against the width ratio of B to A, one line per method (mean ± s.e.)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 3.6))
    for meth in dict.fromkeys(r["method"] for r in rows):
        pts = sorted((r["ratio"], r["barrier_mean"], r["barrier_se"] or 0.0) for r in rows if r["method"] == meth)
        ax.errorbar([p[0] for p in pts], [p[1] for p in pts], yerr=[p[2] for p in pts], marker="o", capsize=3,
                    label=LABELS.get(meth, meth))
    ax.set_xscale("log", base=2)
    ax.set_xticks([r for r in sorted({r["ratio"] for r in rows})])
    ax.set_xticklabels([f"1/{round(1 / r)}" if r < 1 else "1" for r in sorted({r["ratio"] for r in rows})])
    ax.set_xlabel("width of B / width of A (A: d 64)")
    ax.set_ylabel("loss barrier (test)")
    ax.axhline(0, color="grey", lw=0.5)
    ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"wrote {path}")


if __name__ == "__main__":
    raise SystemExit(main())
