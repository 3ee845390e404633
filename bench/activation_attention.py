"""Where activation matching without its head ridge loses the path, on one trained GPT pair.

Aligns the pair by weight matching, by activation matching without the per-head ridge
(``ridge=0``) and with its default ridge, then measures the loss barrier (test split, 5
points of λ) of each, and of weight matching's elements with one kind of space (the
residual stream, the attention heads, the MLP units) taken from the unridged activation
matching; prints the condition numbers of the per-head QK and OV maps each found.

    python bench/activation_attention.py --seeds 2,3

Writes bench/results/activation_attention.json. Uses the checkpoints bench/lmc_table.py
trains (bench/cache) and ../shared/data/tinyshakespeare.txt.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

import trained  # noqa: E402

import symspec  # noqa: E402
from symspec.alignment import ActivationOptions  # noqa: E402
from symspec.analyzers.barrier import loss_barrier  # noqa: E402
from symspec.analyzers.interpolate import PathEvaluator  # noqa: E402
from symspec.transforms import apply_elements  # noqa: E402


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", default="2,3", help="the pair: two seeds of the gpt recipe")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "activation_attention.json")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    data = f"text:{trained.DEFAULT_TEXT}"
    seeds = [int(s) for s in args.seeds.split(",")]
    models = trained.trained_models("gpt", seeds, data, log=lambda m: print(m, flush=True))
    recipe = trained.RECIPES["gpt"]
    test = trained.split("gpt", data, recipe, models[0][0], "test", batch=512)
    train = trained.split("gpt", data, recipe, models[0][0], "train", batch=512)
    a, b = models[0][0], models[1][0]
    rw = symspec.align(a, b, "nanogpt", method="weight")
    ra = symspec.align(a, b, "nanogpt", method="activation", data=train, options=ActivationOptions(ridge=0.0))
    rr = symspec.align(a, b, "nanogpt", method="activation", data=train)
    evaluator = PathEvaluator(rw.canonical_model, test)
    problem = rw.bound.problem

    def barrier(elements: dict[str, Any]) -> float:
        aligned = apply_elements(problem, elements, rw.canonical_b)
        curve = evaluator.curve(rw.canonical_a, aligned, [0.0, 0.25, 0.5, 0.75, 1.0])
        return loss_barrier(curve.lambdas, curve.losses).value

    rows: dict[str, float] = {"weight": barrier(rw.elements), "activation, ridge 0": barrier(ra.elements),
                              f"activation, ridge {ActivationOptions().ridge:g}": barrier(rr.elements)}
    for kind in ("resid", "attn", "ff"):
        mixed = {s: (ra.elements[s] if s.startswith(kind) else rw.elements[s]) for s in problem.spaces}
        rows[f"weight, {kind} from activation (ridge 0)"] = barrier(mixed)
    for name, value in rows.items():
        print(f"{name:<44} barrier {value:.3f}")
    conditions = {}
    for s, si in problem.spaces.items():
        if not s.startswith("attn"):
            continue
        for method, res in (("weight", rw), ("activation-0", ra), ("activation", rr)):
            e = res.elements[s]
            conds = {part: float(torch.linalg.cond(si.group.within(e, part)["matrix"].double()).max()) for part in ("qk", "ov")}
            conditions[f"{s} {method}"] = {"perm": e["perm"].tolist(), **conds}
            print(f"{s} {method:<12} heads {e['perm'].tolist()} max condition qk {conds['qk']:.1f} ov {conds['ov']:.1f}")
    doc = {"schema": "symspec.activation_attention/1",
           "command": trained.command_line("activation_attention.py", argv),
           "seeds": seeds, "barriers": rows, "conditions": conditions}
    trained.write_results(args.out, doc)
    return doc


if __name__ == "__main__":
    main()
