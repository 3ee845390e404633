"""The Gram relaxation (a joint bound over the residual with a layer's spaces) against the
Shor lift and the decoupled bound, then at the widths the Shor lift cannot reach.

    python -m bench.bench_gram [--seeds 0 1 2] [--widths 16 32 64] [--out bench/results/gram.json]

Pairs: nanoGPT (tests/zoo.py, random weights, seed s against s + 10), aligned by weight
matching with permutations for the heads and units and O(d) for the residual
(``groups="perm,resid=full"``). The scope is layer 0 with the residual, every other
space fixed at the result; the bounds are lower bounds on the minimum over it.

- quality (d 8, 2 heads of 4, 4 or 6 units; the Shor lift runs, N = 64 + 4 + 16 or 36):
  the objective at the result, the Shor bound, the Gram bound, the decoupled bound (each
  term maximised alone: residual by its nuclear norm, each unit pair by its own), and the
  share of the decoupled bound's gap to the Shor bound that the Gram bound closes;
- scale (d = n units = W, 4 heads of W / 4): the Gram bound, its relative gap to the
  objective, the objective of the element rounded from the relaxation's solution and
  improved by coordinate ascent (below the result: weight matching stopped above the
  optimum by at least the difference), the Gram matrix size and the seconds (SCS on this
  machine's cores).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import torch

from bench.fixtures import RESULTS, command_line, write_results

CHOSEN = ["resid", "attn[0]", "ff[0]"]


def scope_variables(result: Any, chosen: list[str]) -> tuple[Any, dict[str, Any], dict[str, Any], list[str], torch.Tensor]:
    """(problem, the result's elements in float64, the certificate's variables for
    ``chosen`` in the searched groups, the parameters they touch, the result's point)."""
    import attrs

    from symspec.certify import joint as cj
    from symspec.groups import parse

    problem = result.bound.problem
    spaces = {n: attrs.evolve(si, group=parse(result.searched[n])) if n in result.searched else si
              for n, si in problem.spaces.items()}
    elems = {s: problem.spaces[s].group.to(e, dtype=torch.float64) for s, e in result.elements.items()}
    variables: dict[str, Any] = {}
    offset = 0
    for s in chosen:
        kind, n, u, e0 = cj.variable(spaces[s].group)
        variables[s] = cj.Var(s, kind, n, u, e0, offset)
        offset += n * n
    params = [p for p, pb in problem.params.items() if pb.spaces() & set(chosen)]
    x = torch.cat([cj.value_of(v, problem.spaces[s].group, elems[s]).reshape(-1) for s, v in variables.items()])
    return problem, elems, variables, params, x


def layer_models(seed: int, **size: Any) -> tuple[Any, Any, Any, torch.Tensor]:
    """(dense model or None, star model, variables, the result's point) of layer 0 with the residual."""
    from symspec.alignment import align
    from symspec.certify import joint as cj
    from tests.zoo import ZOO

    a, _ = ZOO["nanogpt"](seed=seed, **size)
    b, _ = ZOO["nanogpt"](seed=seed + 10, **size)
    result = align(a, b, "nanogpt", groups="perm,resid=full")
    problem, elems, variables, params, x = scope_variables(result, CHOSEN)
    dense = None
    if sum(v.n**2 for v in variables.values()) <= cj.JOINT_LIMIT:
        dense = cj.build_model(problem, result.canonical_a, result.canonical_b, elems, variables, params)
    star = cj.build_model(problem, result.canonical_a, result.canonical_b, elems, variables, params, dense=False,
                          hub=variables["resid"])
    assert not isinstance(star, str) and not isinstance(dense, str)
    return dense, star, variables, x


def decoupled(star: Any, variables: dict[str, Any]) -> float:
    """Each term maximised alone: the residual's linear part by its nuclear norm, and per
    leaf an assignment over the unit pairs, each pair with its own residual."""
    from scipy.optimize import linear_sum_assignment  # type: ignore[import-untyped]

    hub = variables["resid"]
    total = float(torch.linalg.svdvals(star.c[hub.offset: hub.offset + hub.n**2].reshape(hub.n, hub.n)).sum())
    for s, v in variables.items():
        if s == "resid":
            continue
        f = torch.cat([ff for _, vp, ff, _ in star.factors if vp is v], -1)
        g = torch.cat([gg for _, vp, _, gg in star.factors if vp is v], -1)
        pair = torch.linalg.svdvals(torch.einsum("Kkq,Llq->KLkl", f, g)).sum(-1)
        score = star.c[v.offset: v.offset + v.n**2].reshape(v.n, v.n) + pair
        r, c = linear_sum_assignment(score.numpy(), maximize=True)
        total += float(score[torch.as_tensor(r), torch.as_tensor(c)].sum())
    return total


def main(argv: list[str] | None = None) -> int:
    from symspec.certify import joint as cj

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--widths", type=int, nargs="+", default=[16, 32, 64])
    ap.add_argument("--out", default=str(RESULTS / "gram.json"))
    args = ap.parse_args(argv)
    quality, scale = [], []
    for seed in args.seeds:
        n_ff = 4 if seed % 3 != 2 else 6
        dense, star, variables, x = layer_models(seed, n_ff=n_ff)
        total = star.constant + star.k

        def as_bound(upper: float, total: float = total, k0: float = star.k0) -> float:
            return total - 2 * (k0 + upper)

        t = time.perf_counter()
        shor, _ = cj.solve_relaxation(dense, list(variables.values()))
        t_shor = time.perf_counter() - t
        t = time.perf_counter()
        gram, _ = cj.gram_relaxation(star, list(variables.values()))
        t_gram = time.perf_counter() - t
        row = {"seed": seed, "n_ff": n_ff, "objective": total - 2 * star.inner(x), "shor_bound": as_bound(shor),
               "gram_bound": as_bound(gram), "decoupled_bound": as_bound(decoupled(star, variables)),
               "shor_seconds": t_shor, "gram_seconds": t_gram}
        row["gram_share_of_gap_closed"] = ((row["gram_bound"] - row["decoupled_bound"])
                                           / max(row["shor_bound"] - row["decoupled_bound"], 1e-30))
        quality.append(row)
        print(f"seed {seed} ({n_ff} units): objective {row['objective']:.4f}; Shor {row['shor_bound']:.4f} ({t_shor:.1f} s), "
              f"Gram {row['gram_bound']:.4f} ({t_gram:.1f} s), decoupled {row['decoupled_bound']:.4f}: the Gram bound "
              f"closes {100 * row['gram_share_of_gap_closed']:.0f}% of the decoupled bound's gap to Shor's", flush=True)
    for w in args.widths:
        _, star, variables, x = layer_models(0, n_head=4, head_dim=w // 4, n_ff=w)
        total = star.constant + star.k
        size = 2 * variables["resid"].n + sum(f.shape[0] * f.shape[-1] for _, _, f, _ in star.factors)
        t = time.perf_counter()
        rounded: dict[str, Any] = {}
        gram, _ = cj.gram_relaxation(star, list(variables.values()), rounded)
        secs = time.perf_counter() - t
        value, bound = total - 2 * star.inner(x), total - 2 * (star.k0 + gram)
        found = min(value, total - 2 * star.inner(rounded["x"]))
        dec = total - 2 * (star.k0 + decoupled(star, variables))
        row = {"d": w, "n_ff": w, "heads": 4, "shor_lifted_size": w * w * 2 + 16, "gram_size": size, "objective": value,
               "gram_bound": bound, "relative_gap": (value - bound) / value, "decoupled_bound": dec,
               "decoupled_relative_gap": (value - dec) / value, "found": found,
               "found_relative_to_result": (value - found) / value, "seconds": secs}
        scale.append(row)
        print(f"d = units = {w}, 4 heads: Gram size {size} (Shor would be N = {row['shor_lifted_size']}); objective "
              f"{value:.4f}, Gram bound {bound:.4f} (gap {100 * row['relative_gap']:.1f}%, decoupled "
              f"{100 * row['decoupled_relative_gap']:.1f}%); rounded from the relaxation: {found:.4f} "
              f"({100 * row['found_relative_to_result']:.2f}% below the result), {secs:.1f} s", flush=True)
    write_results(Path(args.out), {"benchmark": "Gram relaxation: layer 0 with the residual (nanoGPT)",
                                   "command": command_line(__file__, argv), "threads": torch.get_num_threads(),
                                   "quality": quality, "scale": scale})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
