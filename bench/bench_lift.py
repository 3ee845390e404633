"""The fitted lift against a random one, on the same pairs of models of different widths.

    python bench/bench_lift.py [--seeds 0 1 2] [--out bench/results/lift.json]

Pairs (random weights from small configs, nothing downloads; tests/zoo.py):

- planted: B narrow, A = g . lift(B) for a random lift and a random element g of the
  spec's group: what alignment should recover exactly;
- independent: A and B built from different seeds.

For each, B is aligned to A by weight matching after a random lift and after the fitted
lift (symspec.width), and the relative squared weight distance ||A - g.lift(B)||^2 / ||A||^2
is reported (mean over seeds), with the time of each.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT))

from trained import command_line, write_results  # noqa: E402

CASES = {
    "nanogpt": (dict(n_head=2, head_dim=4, n_ff=12), dict(n_head=3, head_dim=4, n_ff=20)),
    "llama": (dict(n_head=4, n_kv=2, head_dim=4, n_ff=12), dict(n_head=4, n_kv=2, head_dim=4, n_ff=16)),
    "gpt2": (dict(n_head=2, head_dim=4), dict(n_head=3, head_dim=4)),
}


def relative(result: Any) -> float:
    import torch

    from symspec.alignment.api import weight_distance

    zero = {k: torch.zeros_like(v) for k, v in result.canonical_a.items()}
    return weight_distance(result.bound, result.canonical_a, result.aligned_b) / weight_distance(result.bound, result.canonical_a, zero)


def main(argv: list[str] | None = None) -> int:
    import torch

    from symspec.alignment import align
    from symspec.planting import plant
    from symspec.spec import load_spec
    from symspec.width import lift
    from tests.zoo import ZOO

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "lift.json"))
    args = ap.parse_args(argv)
    rows = []
    for fam, (kb, ka) in CASES.items():
        spec = load_spec(fam)
        for kind in ("planted", "independent"):
            got: dict[str, list[float]] = {"random": [], "fitted": []}
            secs: dict[str, float] = {"random": 0.0, "fitted": 0.0}
            for seed in args.seeds:
                b, _ = ZOO[fam](seed=seed, **kb)
                if kind == "planted":
                    shape, _ = ZOO[fam](seed=1000 + seed, **ka)
                    a = plant(lift(b, shape, spec, seed=100 + seed, dtype=torch.float32).model, spec, seed=200 + seed).model
                else:
                    a, _ = ZOO[fam](seed=1000 + seed, **ka)
                for how in ("random", "fitted"):
                    t = time.perf_counter()
                    got[how].append(relative(align(a, b, spec, lift=how, lift_seed=seed)))
                    secs[how] += time.perf_counter() - t
            row = {"family": fam, "pairs": kind, "narrow": kb, "wide": ka,
                   **{f"{h}_relative_distance": sum(v) / len(v) for h, v in got.items()},
                   **{f"{h}_all": v for h, v in got.items()}, **{f"{h}_seconds": s / len(args.seeds) for h, s in secs.items()}}
            rows.append(row)
            print(f"{fam:<8} {kind:<12} random lift {row['random_relative_distance']:.3e}  fitted lift "
                  f"{row['fitted_relative_distance']:.3e}  ({row['random_seconds']:.1f} s / {row['fitted_seconds']:.1f} s per pair)",
                  flush=True)
    write_results(Path(args.out), {"benchmark": "fitted vs random lift, then weight matching",
                                   "command": command_line("bench_lift.py", argv), "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
