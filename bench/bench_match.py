"""Weight matching: time per phase, peak memory, the kernel floor, and cost vs layers.

    python -m bench.bench_match [--cases tiny,small,gpt2-small] [--pairs independent,related]
                                [--groups full,perm] [--rounds 5] [--layers 1,2,4,8,12]
                                [--device cpu] [--out bench/results/match.json] [--quick]

Model pairs are nanoGPT models (examples/nanogpt.py: fused qkv, pre-LayerNorm, GELU MLP,
tied embeddings; spec ``nanogpt``), float32, random weights (nothing downloads):

- tiny: 2 layers, d 64, 4 heads, d_ff 256, vocab 65 (the character GPT of DESIGN §5);
- small: 6 layers, d 384, 6 heads, d_ff 1536, vocab 50257;
- gpt2-small: 12 layers, d 768, 12 heads, d_ff 3072, vocab 50257, context 1024 (124M
  parameters; 163M once canonicalisation unties the unembedding).

Also reported: the CPU time of the match (all threads) and the cores it kept busy on
average (CPU time / wall time).

Two kinds of pair: ``independent`` (two seeds of nanoGPT's initialisation: nothing to
find, the hardest assignments) and ``related`` (B = g.A + noise: A's canonical form
moved by a random element g of the full group, plus Gaussian noise of 0.5x each weight's
spread, like two fine-tunes of one model that were re-parametrised; matching-like costs).

Every case runs ``symspec.align(..., method="weight")`` (what ``symspec match`` calls) with a
fixed number of rounds (tol 0), in a fresh subprocess. Reported per case: seconds per
phase; peak memory as the growth of the resident set (VmHWM, reset after the imports)
over the process before the models were built, divided by the size of the two models;
the objective per round; and the floor: the bare kernels of one round that no weight
matching can avoid, timed on the converged pair's own matrices (one SVD of the residual
cross-covariance, one assignment per FF layer and per attention layer). The solver's
time per round is reported as a multiple of that floor. ``--layers`` times 2-round
matches of GPT-2-width models of several depths and fits time = a + b * layers.

Targets (measured, never asserted): the gpt2-small pair, full groups, 5 rounds, under
60 s on 2 CPU cores, peak memory under 3x the two models. The machine may be shared:
the load average at the start of each case is recorded with it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.fixtures import (
    RESULTS,
    ROOT,
    SIZES,
    command_line,
    cpu_seconds,
    gpt_pair,
    module_command,
    reset_peak,
    status_kb,
    write_results,
)


def _floor(result: Any, config: dict[str, int]) -> dict[str, float]:
    """Seconds of the kernels of one round, on the converged pair's matrices."""
    import numpy as np
    import torch
    from scipy.optimize import linear_sum_assignment  # type: ignore[import-untyped]

    from symspec.groups import centred_basis

    ca, cb = result.canonical_a, result.aligned_b
    d, h, layers = config["n_embd"], config["n_head"], config["n_layer"]
    dh = d // h
    out = {"svd": 0.0, "assign_ff": 0.0, "assign_heads": 0.0}
    # the residual's Procrustes: one SVD of the (d-1) x (d-1) reduced cross-covariance
    m = torch.zeros(d, d)
    for p in result.bound.problem.params:
        x = ca[p]
        if x.ndim == 2 and x.shape[1] == d:
            m += x.T @ cb[p]
    bas = centred_basis(d).to(torch.float32)
    red = bas.T @ m @ bas
    t = time.perf_counter()
    torch.linalg.svd(red, full_matrices=False)
    out["svd"] = time.perf_counter() - t
    for i in range(layers):
        fc, pr = f"transformer.h.{i}.mlp.c_fc.weight", f"transformer.h.{i}.mlp.c_proj.weight"
        c = (ca[fc] @ cb[fc].T + ca[pr].T @ cb[pr]).double().numpy()
        # aligned B's units are already in A's order, which makes scipy's assignment much
        # faster than on the solver's matrices: time it in a random column order
        c = np.ascontiguousarray(c[:, np.random.default_rng(i).permutation(c.shape[1])])
        t = time.perf_counter()
        linear_sum_assignment(c, maximize=True)
        out["assign_ff"] += time.perf_counter() - t
        w = f"transformer.h.{i}.attn.c_attn.weight"
        q_a, k_a = ca[w][:d].reshape(h, dh, d), ca[w][d : 2 * d].reshape(h, dh, d)
        q_b, k_b = cb[w][:d].reshape(h, dh, d), cb[w][d : 2 * d].reshape(h, dh, d)
        cq = torch.einsum("aid,bjd->abij", q_a, q_b)
        ck = torch.einsum("aid,bjd->abij", k_a, k_b)
        s = (cq * ck).sum((-1, -2)).double().numpy()
        t = time.perf_counter()
        linear_sum_assignment(np.ascontiguousarray(s), maximize=True)
        out["assign_heads"] += time.perf_counter() - t
    out["total"] = out["svd"] + out["assign_ff"] + out["assign_heads"]
    return out


def run_case(case: dict[str, Any]) -> dict[str, Any]:
    import torch

    import symspec
    from symspec.solvers import WeightOptions

    threads = torch.get_num_threads()
    config = dict(SIZES[case["size"]]) if "size" in case else dict(case["config"])
    load = os.getloadavg()[0]
    reset_peak()
    rss0 = status_kb("VmRSS")
    t0 = time.perf_counter()
    a, b = gpt_pair(config, case["pair"])
    build_s = time.perf_counter() - t0
    model_bytes = sum(p.numel() * p.element_size() for m in (a, b) for p in {id(q): q for q in m.parameters()}.values())
    t0 = time.perf_counter()
    cpu0 = cpu_seconds()
    result = symspec.align(a, b, "nanogpt", method="weight", groups=case["groups"], rounds=case["rounds"], tol=0.0,
                           device=case.get("device", "cpu"), dtype=torch.float32, keep_canonical_b=False,
                           options=WeightOptions(lap_workers=case.get("lap_workers", 1), overlap=case.get("overlap", True)))
    wall = time.perf_counter() - t0
    cpu = cpu_seconds() - cpu0
    peak_kb = status_kb("VmHWM")
    rounds = len(result.history) - 1
    floor = _floor(result, config)
    timings = dict(result.timings)
    per_round = (wall - timings.get("bind", 0.0) - timings.get("canonicalize", 0.0) - timings.get("transform", 0.0)) / max(rounds, 1)
    return {
        **case,
        "config": config,
        "params_per_model": sum(p.numel() for p in {id(q): q for q in a.parameters()}.values()),
        "threads": threads,
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", ""),
        "malloc_mmap_threshold": os.environ.get("MALLOC_MMAP_THRESHOLD_", ""),
        "malloc_arena_max": os.environ.get("MALLOC_ARENA_MAX", ""),
        "load_average": load,
        "build_seconds": build_s,
        "seconds": wall,
        "cpu_seconds": cpu,
        "cores_busy": cpu / wall if wall > 0 else None,
        "rounds": rounds,
        "seconds_per_round": per_round,
        "timings": timings,
        "objective": result.history,
        "relative_objective": [x / result.history[0] for x in result.history],
        "distance": {"canonical": result.distance("canonical"), "aligned": result.distance("aligned")},
        "model_bytes": model_bytes,
        "peak_rss_bytes": (peak_kb - rss0) * 1024,
        "peak_x_models": (peak_kb - rss0) * 1024 / model_bytes,
        "floor_seconds_per_round": floor,
        "solver_x_floor": per_round / floor["total"] if floor["total"] > 0 else None,
    }


def _subprocess(case: dict[str, Any], timeout: float) -> dict[str, Any]:
    from symspec.process import child_environment

    # the process settings `symspec match` makes (passive OpenMP waits, a fixed mmap
    # threshold, one heap arena for all threads)
    env = child_environment(dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")))
    proc = subprocess.run([*module_command(__file__), "--case", json.dumps(case)], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=ROOT)
    if proc.returncode != 0:
        return {**case, "error": proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else f"exit {proc.returncode}"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _fit(xs: list[float], ys: list[float]) -> dict[str, float]:
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else 0.0
    a = my - b * mx
    ss = sum((y - my) ** 2 for y in ys)
    res = sum((y - (a + b * x)) ** 2 for x, y in zip(xs, ys))
    return {"intercept": a, "slope_per_layer": b, "r2": 1 - res / ss if ss else 1.0}


def _label(r: dict[str, Any]) -> str:
    """groups, lap workers, and '-' when the batched solves did not overlap."""
    return f"{r['groups']} w{r.get('lap_workers', 1)}" + ("" if r.get("overlap", True) else "-")


def exact_stats_cost(widths: list[int], vocab: int, repeat: int = 3) -> list[dict[str, Any]]:
    """CPU seconds (one thread, best of ``repeat``) of a static embedding term's statistics
    (``[width, vocab]``, a transposed view as an embedding's segment is): the float32 cross
    weight matching computed before its float64 objective terms (commit 0b14cdc), and
    ``exact_stats`` for an orthogonal action (float64 cross, Gram in float32) and for a
    dense one (both in float64)."""
    import functools

    import torch

    from symspec.solvers.engine.rounding import exact_stats

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    rows = []
    try:
        for d in widths:
            gen = torch.Generator().manual_seed(d)
            a, b = torch.randn(vocab, d, generator=gen).mT, torch.randn(vocab, d, generator=gen).mT
            fns: dict[str, Any] = {"float32_cross": functools.partial(torch.matmul, a, b.mT),
                                   "exact_orthogonal": functools.partial(exact_stats, a, b, 1.0, orthogonal=True),
                                   "exact_dense": functools.partial(exact_stats, a, b, 1.0)}
            best: dict[str, float] = {}
            for _ in range(repeat):
                for k, f in fns.items():
                    c0 = cpu_seconds()
                    f()
                    best[k] = min(best.get(k, float("inf")), cpu_seconds() - c0)
            rows.append({"width": d, "vocab": vocab, "cpu_seconds": best})
            print(f"width {d}, vocab {vocab}: " + ", ".join(f"{k} {v:.2f} s" for k, v in best.items()), flush=True)
    finally:
        torch.set_num_threads(threads)
    return rows


def _print_table(results: list[dict[str, Any]], scaling: dict[str, Any] | None) -> None:
    head = (f"{'case':<12} {'pair':<12} {'groups':<9} {'rounds':>6} {'total s':>8} {'s/round':>8} {'floor s':>8} "
            f"{'x floor':>7} {'peak x':>7} {'rel. obj':>9} {'cores':>5} {'load':>5}")
    print(head)
    print("-" * len(head))
    for r in results:
        if "error" in r:
            print(f"{r.get('size', '?'):<12} {r['pair']:<12} {_label(r):<9} error: {r['error']}")
            continue
        print(f"{r.get('size', 'custom'):<12} {r['pair']:<12} {_label(r):<9} {r['rounds']:>6} {r['seconds']:>8.2f} "
              f"{r['seconds_per_round']:>8.2f} {r['floor_seconds_per_round']['total']:>8.2f} {r['solver_x_floor']:>7.1f} "
              f"{r['peak_x_models']:>7.2f} {r['relative_objective'][-1]:>9.4f} {r.get('cores_busy') or 0:>5.2f} "
              f"{r['load_average']:>5.1f}")
    for r in results:
        if "error" in r:
            continue
        phases = ", ".join(f"{k} {v:.2f}" for k, v in sorted(r["timings"].items(), key=lambda kv: -kv[1]) if v >= 0.01)
        print(f"  {r.get('size', 'custom')}/{r['pair']}/{r['groups']}/lap workers {r.get('lap_workers', 1)}"
              f"/overlap {'on' if r.get('overlap', True) else 'off'}: {phases}")
    if scaling:
        print(f"cost vs layers ({scaling['rounds']} rounds, GPT-2 width, independent pair): "
              + ", ".join(f"{p['layers']}: {p['seconds_per_round']:.2f} s/round" for p in scaling["points"]))
        fit = scaling["fit"]
        if fit:
            print(f"  fit: {fit['intercept']:.2f} s + {fit['slope_per_layer']:.2f} s/layer per round (R^2 {fit['r2']:.3f})")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--case", help=argparse.SUPPRESS)
    ap.add_argument("--cases", default="tiny,small,gpt2-small")
    ap.add_argument("--pairs", default="independent,related")
    ap.add_argument("--groups", default="full,perm")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--layers", default="1,2,4,8", help="depths for the cost-vs-layers sweep ('' to skip)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--lap-workers", default="1", help="comma-separated: assignments solved at once (threads)")
    ap.add_argument("--overlap", default="on", help="comma-separated on/off: batched solves beside the statistics")
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--quick", action="store_true", help="tiny and small only, no layer sweep")
    ap.add_argument("--out", default=str(RESULTS / "match.json"))
    ap.add_argument("--exact-stats", default="", help="widths (e.g. 384,768): time a 50257-token embedding's "
                    "exact statistics only, write them to --out")
    args = ap.parse_args(argv)
    if args.exact_stats:
        rows = exact_stats_cost([int(w) for w in args.exact_stats.split(",")], 50257)
        write_results(Path(args.out), {"benchmark": "exact static statistics of an embedding (CPU seconds, one thread)",
                                       "command": command_line(__file__, argv), "rows": rows})
        return 0
    if args.case:
        print(json.dumps(run_case(json.loads(args.case))))
        return 0
    sizes = ["tiny", "small"] if args.quick else [s for s in args.cases.split(",") if s]
    results = []
    for size in sizes:
        for pair in args.pairs.split(","):
            for groups in args.groups.split(","):
                for workers in [int(w) for w in args.lap_workers.split(",")]:
                    for overlap in args.overlap.split(","):
                        case = {"size": size, "pair": pair, "groups": groups, "rounds": args.rounds, "device": args.device,
                                "lap_workers": workers, "overlap": overlap == "on"}
                        print(f"running {size} {pair} {groups} (lap workers {workers}, overlap {overlap}) ...",
                              file=sys.stderr, flush=True)
                        results.append(_subprocess(case, args.timeout))
    scaling = None
    layers = [] if args.quick or not args.layers else [int(x) for x in args.layers.split(",")]
    if layers:
        points = []
        for n in layers:
            config = dict(SIZES["gpt2-small"], n_layer=n)
            print(f"running {n} layers ...", file=sys.stderr, flush=True)
            r = _subprocess({"config": config, "pair": "independent", "groups": "full", "rounds": 2, "device": args.device}, args.timeout)
            points.append({"layers": n, **({"seconds_per_round": r["seconds_per_round"], "seconds": r["seconds"],
                                            "load_average": r["load_average"]} if "error" not in r else {"error": r["error"]})})
        ok = [p for p in points if "error" not in p]
        full12 = next((r for r in results if r.get("size") == "gpt2-small" and r["pair"] == "independent" and r["groups"] == "full"
                       and "error" not in r), None)
        if full12 is not None and 12 not in layers:
            ok.append({"layers": 12, "seconds_per_round": full12["seconds_per_round"], "note": "from the gpt2-small case"})
        scaling = {"rounds": 2, "points": ok, "fit": _fit([p["layers"] for p in ok], [p["seconds_per_round"] for p in ok]) if len(ok) > 1 else {}}
    machine: dict[str, Any] = {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version()}
    report: dict[str, Any] = {
        "benchmark": "weight matching (symspec.align, method=\"weight\")",
        "command": command_line(__file__, argv),
        "machine": machine,
        "targets": {"gpt2-small full 5 rounds seconds": 60, "peak x two models": 3},
        "results": results,
        "scaling": scaling,
    }
    try:
        import torch

        machine["torch"] = str(torch.__version__)
        machine["threads"] = torch.get_num_threads()
        if args.device.startswith("cuda") and torch.cuda.is_available():
            machine["gpu"] = torch.cuda.get_device_name(0)
    except ImportError:
        pass
    write_results(Path(args.out), report)
    _print_table(results, scaling)
    return 0


if __name__ == "__main__":
    sys.exit(main())
