"""Learned matching's variants, measured on the LMC benchmark's first pair of each task.

Which parametrisation of the orthogonal residual trains better (``exp``: g0 exp(X - X^T),
or ``polar``: the polar factor of a free latent), whether learning the permutations
(straight-through estimator, Sinkhorn) changes them or the barrier (the paper finds it
barely does), and what the schedule, the lambdas and the start change (``lr=...``,
``steps*4``, ``warmup=0.2``, ``lambda=uniform``, ``init=auto``, ``average=0.99``, ``path=3``: :data:`VARIANTS`). For each variant: the loss barrier on the test split (11 points), the best
midpoint loss on the val split, the wall time, how far the residual map moved from weight
matching's (largest eigen-angle of O_learned O_wm^T), the fraction of FF units whose
permutation changed, the worst condition number of the per-head GL maps. Weight
matching's barrier on the same pair is the reference.

    python -m bench.bench_learned                 # both tasks, 300 steps each variant
    python -m bench.bench_learned --tasks gpt --steps 100

Writes bench/results/learned_variants.json. Uses the checkpoints bench/lmc_table.py
trains (bench/cache; trained here the first time) and ../shared/data.
"""

from __future__ import annotations

import argparse
import platform
import time
from pathlib import Path
from typing import Any

import torch

from bench import trained
from bench.fixtures import RESULTS, command_line, write_results
from symspec.analyzers.barrier import Measurer
from symspec.learned import LearnedOptions

TASKS = {"gpt": ("nanogpt", f"text:{trained.DEFAULT_TEXT}"), "vit": ("vit", f"mnist:{trained.DEFAULT_MNIST}")}
#: each variant's LearnedOptions beside the defaults (``steps_x``: that many times --steps)
VARIANTS: dict[str, dict[str, Any]] = {
    "exp": {}, "polar": {"orthogonal": "polar"}, "exp+ste": {"permutations": "ste"},
    "exp+sinkhorn": {"permutations": "sinkhorn"},
    # the schedule, the lambdas, the start
    "lr=3e-3": {"lr": 3e-3}, "lr=3e-2": {"lr": 3e-2}, "steps*4": {"steps_x": 4}, "warmup=0.2": {"warmup": 0.2},
    "lambda=uniform": {"lam": "uniform"}, "init=auto": {"init": "auto"},
    "init=auto+steps*4": {"init": "auto", "steps_x": 4},
    "init=auto+lr=3e-2+steps*4": {"init": "auto", "lr": 3e-2, "steps_x": 4},
    # per-kind learning rates: the residual's rotation and the heads' GL maps move at different scales
    "linear*0.3": {"lr_scale": (("linear", 0.3),)}, "orthogonal*3": {"lr_scale": (("orthogonal", 3.0),)},
    # the iterates averaged (an EMA of the latents validated beside them), the path's loss
    "average=0.99": {"average": 0.99}, "average=0.999": {"average": 0.999}, "path=3": {"path_points": 3},
    "init=auto+lr=3e-2+steps*4+average=0.99": {"init": "auto", "lr": 3e-2, "steps_x": 4, "average": 0.99},
}


def summarize(info: dict[str, Any]) -> dict[str, Any]:
    spaces = info.get("spaces", {})
    angles = [d["max_angle_from_start"] for d in spaces.values() if "max_angle_from_start" in d]
    moved = [d["moved"] for s, d in spaces.items() if "moved" in d and s.startswith("ff")]
    return {"best_val_midpoint": info["best_val_midpoint_loss"], "best_step": info["best_step"],
            "start_val_midpoint": info["val_midpoint_loss"][0][1],
            "resid_max_angle": max(angles) if angles else None,
            "ff_moved": (sum(moved) / len(moved)) if moved else 0.0,
            "max_condition": info.get("max_condition"), "check_max_rel": info["check"]["max_rel"],
            "best_from": info.get("best_from")}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tasks", default="gpt,vit")
    p.add_argument("--variants", default="exp,polar,exp+ste,exp+sinkhorn", help=f"known: {', '.join(VARIANTS)}")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", type=Path, default=RESULTS / "learned_variants.json")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    unknown = [v.strip() for v in args.variants.split(",") if v.strip() and v.strip() not in VARIANTS]
    if unknown:
        raise SystemExit(f"unknown variant {unknown[0]}; known: {', '.join(VARIANTS)}")
    rows = []
    print(f"{'task':<5} {'variant':<18} {'barrier':>8} {'val mid':>8} {'start':>8} {'seconds':>8} {'angle':>6} "
          f"{'ff moved':>8} {'max cond':>9}")
    for task in [t.strip() for t in args.tasks.split(",") if t.strip()]:
        spec, data = TASKS[task]
        recipe = trained.RECIPES[task]
        models = trained.trained_models(task, [0, 1], data, log=lambda m: print(m, flush=True))
        a, b = models[0][0], models[1][0]
        split = {s: trained.split(task, data, recipe, a, s, batch=512) for s in ("train", "val", "test")}
        m = Measurer(split["test"], points=11, align_data=split["train"], align_validation=split["val"])
        t0 = time.perf_counter()
        ref = m.pair(a, b, method="weight", spec=spec)
        rows.append({"task": task, "variant": "weight matching", "barrier": ref.barrier.value,
                     "seconds": time.perf_counter() - t0})
        print(f"{task:<5} {'weight':<18} {ref.barrier.value:>8.3f}", flush=True)
        for name in [v.strip() for v in args.variants.split(",") if v.strip()]:
            over = dict(VARIANTS[name])
            steps = args.steps * over.pop("steps_x", 1)
            opts = LearnedOptions(**{"steps": steps, "batch_size": args.batch_size, "lr": args.lr, **over})
            t0 = time.perf_counter()
            r = m.pair(a, b, method="learned", spec=spec, align_kw={"options": opts})
            seconds = time.perf_counter() - t0
            facts = summarize(dict(r.align_info["info"]))
            rows.append({"task": task, "variant": name, "steps": steps, "barrier": r.barrier.value, "seconds": seconds, **facts})
            angle = facts["resid_max_angle"]
            print(f"{task:<5} {name:<18} {r.barrier.value:>8.3f} {facts['best_val_midpoint']:>8.3f} "
                  f"{facts['start_val_midpoint']:>8.3f} {seconds:>8.1f} {angle if angle is not None else float('nan'):>6.3f} "
                  f"{facts['ff_moved']:>8.3f} {facts['max_condition'] or float('nan'):>9.1f}", flush=True)
    doc = {"schema": "symspec.bench_learned/1", "command": command_line(__file__, argv),
           "machine": {"python": platform.python_version(), "torch": torch.__version__, "threads": torch.get_num_threads()},
           "steps": args.steps, "batch_size": args.batch_size, "lr": args.lr, "rows": rows}
    write_results(args.out, doc)
    return doc


if __name__ == "__main__":
    main()
