"""The pair score of a permutation with a scaling before it (gated MLP units): one scale
per pair (symspec.solvers.kinds.assignment.scaled_pair_score) against the per-side upper bound
it replaced (C^2/G on each side), next to the assignment that reads it.

    python -m bench.bench_pair_score [--sizes 1024 3072 8192] [--repeat 3] [--seeds 0 1 2 3 4]
                                     [--candidates 4864] [--out bench/results/pair_score.json]

Speed: random statistics (a co and a contra pair term of f units, float32, as a float32
model's weight matching builds them); the seconds are the best of ``--repeat`` runs, all
in one process, so compare the ratios.

Exactness: on the random statistics of the smallest size, the score against the true
maximum over d (the best of the quartic's real roots, each polished; slow, done once):
the share of pairs whose score is within 1e-6 of it and the largest shortfall, both
relative to the pair's per-side bound (float64).

Candidates: a wide layer's assignment scores exactly only each unit's most promising pairs
(``assignment.assign_scaled``: PRUNE_CANDIDATES per row and per column by the per-side
bound, then a sparse assignment). On the statistics of a gated MLP of ``--candidates``
units and a fifth as many inputs, B planted from A (a permutation and scales) with noise
of a growing share added to A (0: planted; 30: nearly independent), in one process: the
time of the full score and its dense assignment against the candidates' way, how many
units the two assignments agree on, and how much higher the candidates' objective
(||A - g B||^2 at the score's scales) ends than the full score's, relative to what the
full one gained over the identity.

Quality: weight matching of independent Llama pairs (tests/zoo.py, random weights, 2
layers, d 32, 64 SwiGLU units, float32), once with each score, in one process: the
objective each ends at with this score, with the exact maximum per pair (the quartic's
roots, slow) and with the per-side bound it replaced (lower is better; the descent only
accepts improvements, so every score gives a valid alignment).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from bench.fixtures import RESULTS, best_of, command_line, write_results


def measure(n: int, repeat: int) -> dict[str, float]:
    import functools

    import torch

    from symspec.groups import D
    from symspec.solvers.engine.base import StatTerm
    from symspec.solvers.kinds.assignment import assign, scaled_pair_score

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


def per_side_score(terms, inner):  # type: ignore[no-untyped-def]
    """The score this replaced: C^2/G on each scaled side, each with its own scale."""
    import torch

    score = None
    for t in terms:
        c = t.cross()
        if t.role == "outer":
            part = c
        elif t.role == "pair":
            g = t.gram_diag()
            num = c.clamp_min(0) if (inner.positive_only or t.inner_variance == "abs") else c
            part = torch.where(g > 0, num.square() / torch.where(g > 0, g, 1.0), 0.0)
        else:
            continue
        score = part if score is None else score + part
    return score


def exactness(n: int) -> dict[str, float]:
    import torch

    from symspec.solvers.kinds.smooth import best_scale_value, exact_scale_value

    gen = torch.Generator().manual_seed(n)
    c_co, c_ct = torch.randn(n, n, generator=gen), torch.randn(n, n, generator=gen)
    g_co, g_ct = torch.rand(1, n, generator=gen) + 0.5, torch.rand(1, n, generator=gen) + 0.5
    got = best_scale_value({"c_co": c_co.double(), "g_co": g_co.double(), "c_ct": c_ct.double(), "g_ct": g_ct.double(),
                            "c_ab": 0.0, "g_ab": 0.0}, False)
    coef = {k: v.double().expand(n, n) for k, v in {"c_co": c_co, "g_co": g_co, "c_ct": c_ct, "g_ct": g_ct}.items()}
    coef |= {"c_ab": torch.zeros(n, n, dtype=torch.float64), "g_ab": torch.zeros(n, n, dtype=torch.float64)}
    # every real root of the stationarity quartic g_co d^4 - c_co d^3 + c_ct d - g_ct = 0, polished
    exact = exact_scale_value(coef, False)
    # relative to the pair's scale: the per-side bound c_co^2/g_co + c_ct^2/g_ct
    short = (exact - got) / (coef["c_co"] ** 2 / coef["g_co"] + coef["c_ct"] ** 2 / coef["g_ct"])
    top = exact.topk(5, dim=-1).indices  # the pairs an assignment would choose among
    short_top = torch.gather(short, -1, top)
    return {"pairs": n * n, "share_exact": float((short <= 1e-6).double().mean()), "largest_shortfall": float(short.max()),
            "share_exact_top5": float((short_top <= 1e-6).double().mean()), "largest_shortfall_top5": float(short_top.max()),
            "above_exact": float((-short).max())}


def quality(seeds: list[int]) -> list[dict[str, float]]:
    import torch

    import symspec
    import symspec.solvers.kinds.assignment as asg
    import symspec.solvers.kinds.smooth as smooth
    from tests.zoo import ZOO

    one_scale, value, exact_scale_value = asg.scaled_pair_score, smooth.best_scale_value, smooth.exact_scale_value
    rows = []
    for seed in seeds:
        a, _ = ZOO["llama"](seed=seed, head_dim=8, n_ff=64)
        b, _ = ZOO["llama"](seed=100 + seed, head_dim=8, n_ff=64)
        row: dict[str, float] = {"seed": seed}
        def exact_max(coef, positive, work=None):  # type: ignore[no-untyped-def]
            return exact_scale_value(coef, positive)

        for name, score, val in (("one_scale", one_scale, value), ("exact_max", one_scale, exact_max),
                                 ("per_side", per_side_score, value)):
            asg.scaled_pair_score, smooth.best_scale_value = score, val
            try:
                res = symspec.align(a, b, "llama", rounds=20)
            finally:
                asg.scaled_pair_score, smooth.best_scale_value = one_scale, value
            row[f"{name}_objective"] = float(res.history[-1])
        row["ratio"] = row["one_scale_objective"] / row["per_side_objective"]
        rows.append(row)
        print(f"llama pair {seed}: objective {row['one_scale_objective']:.4f} (one scale), "
              f"{row['exact_max_objective']:.4f} (exact maximum per pair), {row['per_side_objective']:.4f} (per side); "
              f"one scale / per side {row['ratio']:.4f}", flush=True)
    del torch
    return rows


def candidates(n: int, noises: list[float]) -> list[dict[str, float]]:
    import time

    import torch

    from symspec.groups import D
    from symspec.solvers.engine.base import SolveContext, StatTerm
    from symspec.solvers.kinds import assignment as asg

    d = max(1, n // 5)
    rows = []
    for noise in noises:
        gen = torch.Generator().manual_seed(int(noise * 10) + n)
        gate, up, down = (torch.randn(n, d, generator=gen) for _ in range(3))
        perm = torch.randperm(n, generator=gen)
        scale = torch.exp(0.5 * torch.randn(n, generator=gen)) * torch.sign(torch.randn(n, generator=gen))
        a_gate = gate[perm] + noise * torch.randn(n, d, generator=gen)
        a_up = (up * scale[:, None])[perm] + noise * torch.randn(n, d, generator=gen)
        a_down = (down / scale[:, None])[perm] + noise * torch.randn(n, d, generator=gen)
        terms = [StatTerm((), "co", a_gate @ gate.T, None, None, role="outer"),
                 StatTerm((), "co", a_up @ up.T, None, None, role="pair", inner_variance="co"),
                 StatTerm((), "contra", a_down @ down.T, None, None, role="pair", inner_variance="contra")]
        for t, b in zip(terms[1:], (up, down)):
            t.gram_diag = (lambda x: lambda: x.square().sum(1))(b)  # type: ignore[method-assign]
        t0 = time.perf_counter()
        full = asg.scaled_pair_score(terms, D(n))
        assert full is not None
        p_full = asg.assign(full)
        t1 = time.perf_counter()
        p_cand = asg.assign_scaled(terms, D(n), SolveContext(dtype=torch.float32))
        t2 = time.perf_counter()
        assert p_cand is not None
        ar = torch.arange(n)
        norm = float(a_gate.double().square().sum() + a_up.double().square().sum() + a_down.double().square().sum())
        v_full, v_cand, v_id = (float(full[ar, p].double().sum()) for p in (p_full, p_cand, ar))
        row = {"f": n, "noise": noise, "full_seconds": t1 - t0, "candidates_seconds": t2 - t1,
               "speedup": (t1 - t0) / (t2 - t1), "units_agreeing": float((p_full == p_cand).double().mean()),
               "objective_full": norm - v_full, "objective_candidates": norm - v_cand,
               "loss_of_gain": (v_full - v_cand) / max(v_full - v_id, 1e-300)}
        rows.append(row)
        print(f"candidates, f {n}, noise {noise:g}: full {row['full_seconds']:.2f} s, candidates {row['candidates_seconds']:.2f} s "
              f"({row['speedup']:.1f}x); {100 * row['units_agreeing']:.2f}% of units assigned alike; objective "
              f"{row['objective_candidates']:.6g} vs {row['objective_full']:.6g} "
              f"({100 * row['loss_of_gain']:.3f}% of the full score's gain lost)", flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    import torch

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[1024, 3072, 8192])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    ap.add_argument("--candidates", type=int, nargs="*", default=[4864],
                    help="layer widths at which the candidates' way is compared with the full score")
    ap.add_argument("--noises", type=float, nargs="+", default=[0.0, 3.0, 10.0, 30.0])
    ap.add_argument("--out", type=Path, default=RESULTS / "pair_score.json")
    args = ap.parse_args(argv)
    rows = []
    for n in args.sizes:
        row = measure(n, args.repeat)
        rows.append(row)
        print(f"f {n:>6}: one scale per pair {row['one_scale_seconds']:.3f} s, per-side bound {row['per_side_seconds']:.3f} s, "
              f"assignment {row['assignment_seconds']:.3f} s ({row['one_scale_over_assignment']:.2f} of the assignment)", flush=True)
    exact = exactness(min(args.sizes))
    print(f"exactness on {exact['pairs']} random pairs: {100 * exact['share_exact']:.2f}% within 1e-6 of the maximum "
          f"(largest shortfall {exact['largest_shortfall']:.2e}); among each row's 5 best pairs "
          f"{100 * exact['share_exact_top5']:.2f}% (largest shortfall {exact['largest_shortfall_top5']:.2e})", flush=True)
    cand = [r for n in args.candidates for r in candidates(n, args.noises)]
    pairs = quality(args.seeds)
    write_results(args.out, {"benchmark": "pair score of a permutation with a scaling", "command": command_line(__file__, argv),
                             "torch": torch.__version__, "threads": torch.get_num_threads(), "rows": rows,
                             "exactness": exact, "candidates": cand, "llama_pairs": pairs})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
