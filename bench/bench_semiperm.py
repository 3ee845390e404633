"""Semi-permutation matching: the exact method, the cvxpy LP relaxation (with its lower
bound) and the greedy assignment, on the same problems.

    python -m bench.bench_semiperm [--sizes 16x8 64x32 256x128 1024x256] [--seeds 0 1 2]
                                   [--out bench/results/semiperm.json]

Problems: random costs (uniform) of each size, and the unit costs of the fitted lift
on the trained character GPTs of bench/bench_width.py when they are cached (wide d 64,
narrow d 8, 16, 32: A's MLP units against B's, incoming weights in A's residual frame).
For each: the cost of each method's assignment relative to the LP bound (1.0 = certified
optimal), and the time. The LP is skipped above --lp-max rows x columns.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from bench.fixtures import RESULTS, command_line, write_results


def run(cost: Any, lp_max: int) -> dict[str, Any]:
    from symspec.width.assign import semiperm_assignment

    out: dict[str, Any] = {"shape": list(cost.shape)}
    for method in ("exact", "greedy", "lp"):
        if method == "lp" and cost.numel() > lp_max:
            continue
        t = time.perf_counter()
        a = semiperm_assignment(cost, method)
        out[method] = {"cost": a.cost, "seconds": time.perf_counter() - t}
        if a.bound is not None:
            out["lp_bound"] = a.bound
    ref = out.get("lp_bound", out["exact"]["cost"])
    for method in ("exact", "greedy", "lp"):
        if method in out:
            out[method]["over_bound"] = out[method]["cost"] / ref if ref else 1.0
    return out


def trained_costs() -> list[tuple[str, Any]]:
    """Unit costs of the fitted lift on the cached width-benchmark GPTs (none if not cached)."""
    import torch

    from bench import bench_width, trained
    from symspec.binding import bind
    from symspec.spec import load_spec
    from symspec.width.fit import unit_costs
    from symspec.width.lifting import canonical_f64, lift

    out = []
    spec = load_spec("nanogpt")
    data = f"text:{trained.DEFAULT_TEXT}"
    if not trained.DEFAULT_TEXT.exists():
        return []
    wide = trained.trained_models("gpt", [0], data, log=lambda *a: None)[0][0]
    ba = bind(spec, wide)
    canon_a = canonical_f64(ba, wide)
    for ratio in (0.125, 0.25, 0.5):
        narrow = trained.trained_models("gpt", [100], data, recipe=bench_width.recipe(ratio), log=lambda *a: None)[0][0]
        lifted = lift(narrow, wide, spec, seed=0, dtype=torch.float64)
        bb = bind(spec, narrow)
        canon_b = canonical_f64(bb, narrow)
        for name in ("ff[0]", "ff[1]"):
            out.append((f"gpt d64 vs d{round(64 * ratio)} {name}", unit_costs(ba.problem, canon_a, bb.problem, canon_b, lifted, name)))
    return out


def main(argv: list[str] | None = None) -> int:
    import torch

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", nargs="+", default=["16x8", "64x32", "256x128", "1024x256"])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--lp-max", type=int, default=300_000)
    ap.add_argument("--out", default=str(RESULTS / "semiperm.json"))
    args = ap.parse_args(argv)
    rows = []
    for size in args.sizes:
        na, nb = (int(v) for v in size.split("x"))
        for seed in args.seeds:
            cost = torch.rand(na, nb, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
            rows.append({"problem": f"random {size}", "seed": seed, **run(cost, args.lp_max)})
    for label, cost in trained_costs():
        rows.append({"problem": label, **run(cost, args.lp_max)})
    for r in rows:
        cells = "  ".join(f"{m} {r[m]['over_bound']:.4f}x ({r[m]['seconds']:.2f} s)" for m in ("exact", "lp", "greedy") if m in r)
        print(f"{r['problem']:<28} {r.get('seed', ''):>2}  {cells}", flush=True)
    write_results(Path(args.out), {"benchmark": "semi-permutation matching: exact, LP relaxation (cvxpy), greedy",
                                   "command": command_line(__file__, argv), "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
