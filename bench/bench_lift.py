"""The fitted lifts (on weights, on activations) against a random one, on the same pairs
of models of different widths.

    python -m bench.bench_lift [--seeds 0 1 2] [--out bench/results/lift.json]

Pairs (random weights from small configs, nothing downloads; tests/zoo.py):

- planted: B narrow, A = g . lift(B) for a random lift and a random element g of the
  spec's group: what alignment should recover exactly;
- independent: A and B built from different seeds.

For each, B is aligned to A by weight matching after a random lift, after the lift
fitted on the weights and after the lift fitted on activations (``lift="activation"``:
data are 8 batches of random token sequences of the family's test inputs; the alignment
after it is still weight matching, so the columns differ only in the lift), and the
relative squared weight distance ||A - g.lift(B)||^2 / ||A||^2 is reported (mean over
seeds), with the time of each. Planted pairs are built in float32 (as a saved model
would be) and in float64 (``planted64``: recovery to rounding is the claim).
"""

from __future__ import annotations

import argparse
import time
import types
from pathlib import Path
from typing import Any

from bench.fixtures import RESULTS, command_line, write_results

CASES = {
    "nanogpt": (dict(n_head=2, head_dim=4, n_ff=12), dict(n_head=3, head_dim=4, n_ff=20)),
    "nanogpt-wider-heads": (dict(n_head=2, head_dim=4, n_ff=12), dict(n_head=3, head_dim=6, n_ff=20)),
    "llama": (dict(n_head=4, n_kv=2, head_dim=4, n_ff=12), dict(n_head=4, n_kv=2, head_dim=4, n_ff=16)),
    "llama-gqa": (dict(n_head=4, n_kv=2, head_dim=4, n_ff=12), dict(n_head=8, n_kv=4, head_dim=4, n_ff=16)),
    "gpt2": (dict(n_head=2, head_dim=4), dict(n_head=3, head_dim=4)),
}
LIFTS = ("random", "fitted", "activation")


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
    ap.add_argument("--out", default=str(RESULTS / "lift.json"))
    args = ap.parse_args(argv)
    rows = []
    for case, (kb, ka) in CASES.items():
        fam = case.split("-")[0]
        spec = load_spec(fam)
        for kind in ("planted", "planted64", "independent"):
            got: dict[str, list[float]] = {h: [] for h in LIFTS}
            secs: dict[str, float] = {h: 0.0 for h in LIFTS}
            for seed in args.seeds:
                b, _ = ZOO[fam](seed=seed, **kb)
                if kind == "planted64":
                    b = b.double()
                data = types.SimpleNamespace(batches=[(ZOO[fam](seed=100 * seed + i, **kb)[1], None) for i in range(8)])
                if kind.startswith("planted"):
                    shape, _ = ZOO[fam](seed=1000 + seed, **ka)
                    dtype = torch.float64 if kind == "planted64" else torch.float32
                    a = plant(lift(b, shape, spec, seed=100 + seed, dtype=dtype).model, spec, seed=200 + seed).model
                else:
                    a, _ = ZOO[fam](seed=1000 + seed, **ka)
                for how in LIFTS:
                    t = time.perf_counter()
                    got[how].append(relative(align(a, b, spec, lift=how, lift_seed=seed,
                                                   data=data if how == "activation" else None)))
                    secs[how] += time.perf_counter() - t
            row = {"case": case, "family": fam, "pairs": kind, "narrow": kb, "wide": ka,
                   **{f"{h}_relative_distance": sum(v) / len(v) for h, v in got.items()},
                   **{f"{h}_all": v for h, v in got.items()}, **{f"{h}_seconds": s / len(args.seeds) for h, s in secs.items()}}
            rows.append(row)
            print(f"{case:<20} {kind:<12} " + "  ".join(f"{h} {row[h + '_relative_distance']:.3e}" for h in LIFTS)
                  + "  (" + " / ".join(f"{row[h + '_seconds']:.1f}" for h in LIFTS) + " s per pair)", flush=True)
    write_results(Path(args.out), {"benchmark": "fitted (weights, activations) vs random lift, then weight matching",
                                   "command": command_line(__file__, argv), "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
