"""The pair score of a permutation with a scaling before it (gated MLP units): one scale
per pair (symspec.solvers.assignment.scaled_pair_score) against the per-side upper bound
it replaced (C^2/G on each side), next to the assignment that reads it.

    python bench/bench_pair_score.py [--sizes 1024 3072 8192] [--repeat 3]
                                     [--out bench/results/pair_score.json]

Random statistics (a co and a contra pair term of f units, float32, as a float32 model's
weight matching builds them); the seconds are the best of ``--repeat`` runs, all in one
process, so compare the ratios.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def best_of(fn, repeat: int) -> float:  # type: ignore[no-untyped-def]
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def measure(n: int, repeat: int) -> dict[str, float]:
    import functools

    import torch

    from symspec.groups import D
    from symspec.solvers.assignment import assign, scaled_pair_score
    from symspec.solvers.base import StatTerm

    gen = torch.Generator().manual_seed(n)
    c1, c2 = torch.randn(n, n, generator=gen), torch.randn(n, n, generator=gen)
    g1, g2 = torch.rand(n, generator=gen) + 0.5, torch.rand(n, generator=gen) + 0.5
    terms = [StatTerm((), "co", c1, torch.diag(g1), g1, role="pair", inner_variance="co"),
             StatTerm((), "contra", c2, torch.diag(g2), g2, role="pair", inner_variance="contra")]
    score = scaled_pair_score(terms, D(n))
    assert score is not None

    def per_side() -> torch.Tensor:
        return c1.square() / g1 + c2.square() / g2

    one = best_of(functools.partial(scaled_pair_score, terms, D(n)), repeat)
    side = best_of(per_side, repeat)
    asg = best_of(functools.partial(assign, score), 1 if n > 4096 else repeat)
    return {"f": n, "one_scale_seconds": one, "per_side_seconds": side, "assignment_seconds": asg,
            "one_scale_over_assignment": one / asg}


def main(argv: list[str] | None = None) -> int:
    import torch

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[1024, 3072, 8192])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "pair_score.json")
    args = ap.parse_args(argv)
    rows = []
    for n in args.sizes:
        row = measure(n, args.repeat)
        rows.append(row)
        print(f"f {n:>6}: one scale per pair {row['one_scale_seconds']:.3f} s, per-side bound {row['per_side_seconds']:.3f} s, "
              f"assignment {row['assignment_seconds']:.3f} s ({row['one_scale_over_assignment']:.2f} of the assignment)", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"benchmark": "pair score of a permutation with a scaling",
                                    "command": shlex.join(["python", "bench/bench_pair_score.py", *(argv if argv is not None else sys.argv[1:])]),
                                    "torch": torch.__version__, "threads": torch.get_num_threads(), "rows": rows}, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
