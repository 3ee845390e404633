"""Activation matching's statistics pass against a plain forward pass, and its memory.

    python -m bench.bench_activation [--cases tiny,gpt2-small] [--batches 2,8] [--batch-size 8]
                                     [--rounds 1] [--out bench/results/activation.json]
                                     [--label streamed] [--append]

Model pairs are nanoGPT models (examples/nanogpt.py, spec ``nanogpt``; the sizes of
bench/bench_match.py: ``tiny`` is the shape of the LMC benchmark's GPT, ``gpt2-small``
GPT-2 small's), ``related`` pairs (B = g.A + noise), float32, random weights; the data
are random token batches of ``--batch-size`` sequences of the model's context (tiny:
64, gpt2-small: 256 tokens). Each case runs in a fresh subprocess:

- a plain forward pass of both models over the batches (``torch.no_grad``): the floor;
- ``symspec.align(..., method="activation")`` reading the same batches, one round.

Reported: seconds per 1,000 tokens of the statistics pass (both models through the
fx recorder, moments accumulated) and of the plain forward pass, and their ratio
(target <= 1.3); the statistics' size (float64 moments, fixed by the sites' widths) and
what keeping the activations would take instead (tokens x features, both models,
float32); the peak resident memory beyond the two models, as a multiple of the models,
and the whole peak (models included) as a multiple of the models (issue 30's target:
<= 2). Targets are measured, never asserted; the machine may be shared (the load average
at the start of each case is recorded). Each row carries ``--label`` (what code it
measured); ``--append`` keeps the file's rows of other labels (a before/after table).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import time
from pathlib import Path
from typing import Any

from bench.fixtures import (
    RESULTS,
    ROOT,
    SIZES,
    command_line,
    gpt_pair,
    module_command,
    reset_peak,
    status_kb,
    write_results,
)

CONTEXT = {"tiny": 64, "small": 256, "gpt2-small": 256}


def run_case(case: str, batches: int, batch_size: int, rounds: int) -> dict[str, Any]:
    import torch

    import symspec
    from symspec.process import configure_process

    configure_process()
    config = dict(SIZES[case], block_size=CONTEXT.get(case, 64))
    base = status_kb("VmRSS")
    a, b = gpt_pair(config, "related")
    gen = torch.Generator().manual_seed(0)
    data = type("Data", (), {})()
    data.batches = [(torch.randint(0, config["vocab_size"], (batch_size, config["block_size"]), generator=gen), None)
                    for _ in range(batches)]
    models = status_kb("VmRSS")
    with torch.no_grad():  # the floor: both models over the same batches
        a(data.batches[0][0]), b(data.batches[0][0])  # warm-up
        t = time.perf_counter()
        for x, _ in data.batches:
            a(x), b(x)
        forward = time.perf_counter() - t
    reset_peak()
    from symspec.alignment import ActivationOptions

    t = time.perf_counter()
    res = symspec.align(a, b, "nanogpt", method="activation", data=data, rounds=rounds, tol=0.0,
                        options=ActivationOptions(batches=None))
    wall = time.perf_counter() - t
    stats = res.info["statistics"]
    return {
        "case": case, "batches": batches, "batch_size": batch_size, "tokens": stats["tokens"],
        "sites": stats["sites"], "statistics_bytes": stats["bytes"],
        "seconds": {"statistics": res.timings.get("statistics", 0.0), "factor": res.timings.get("factor", 0.0),
                    "forward": forward, "total": wall},
        "objective": res.history, "peak_growth_mb": (status_kb("VmHWM") - base) / 1024,
        "models_mb": (models - base) / 1024, "site_features": stats["features"],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", default="tiny,gpt2-small")
    p.add_argument("--batches", default="2,8")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--out", type=Path, default=RESULTS / "activation.json")
    p.add_argument("--label", default="streamed", help="what code the rows measured (kept in each row)")
    p.add_argument("--append", action="store_true", help="keep the rows of other labels already in --out")
    p.add_argument("--case", help=argparse.SUPPRESS)  # one case in this process: CASE:BATCHES
    args = p.parse_args(argv)
    if args.case:
        case, n = args.case.split(":")
        print(json.dumps(run_case(case, int(n), args.batch_size, args.rounds)))
        return 0
    rows = []
    print(f"{'case':10} {'batches':>7} {'tokens':>7} {'stats s/1k':>10} {'fwd s/1k':>9} {'ratio':>6} "
          f"{'stats MB':>9} {'acts MB':>9} {'models MB':>9} {'beyond/models':>13} {'peak/models':>11}")
    for case in args.cases.split(","):
        for n in [int(x) for x in args.batches.split(",")]:
            cmd = [*module_command(__file__), "--case", f"{case}:{n}", "--batch-size", str(args.batch_size),
                   "--rounds", str(args.rounds)]
            load = os.getloadavg()[0]
            out = subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=ROOT).stdout
            row = json.loads(out.strip().splitlines()[-1]) | {"load_average": load}
            # what keeping the activations would cost: every site's features, both models, float32
            row["activations_bytes"] = 2 * 4 * row["tokens"] * row.pop("site_features")
            k = row["tokens"] / 1000
            sec = row["seconds"]
            row["per_1k_tokens"] = {"statistics": sec["statistics"] / k, "forward": sec["forward"] / k}
            row["statistics_vs_forward"] = sec["statistics"] / sec["forward"]
            row["peak_beyond_models_vs_models"] = (row["peak_growth_mb"] - row["models_mb"]) / row["models_mb"]
            row["peak_vs_models"] = row["peak_growth_mb"] / row["models_mb"]
            row["label"] = args.label
            rows.append(row)
            print(f"{case:10} {n:7d} {row['tokens']:7d} {row['per_1k_tokens']['statistics']:10.3f} "
                  f"{row['per_1k_tokens']['forward']:9.3f} {row['statistics_vs_forward']:6.2f} "
                  f"{row['statistics_bytes'] / 2**20:9.1f} {row['activations_bytes'] / 2**20:9.1f} "
                  f"{row['models_mb']:9.1f} {row['peak_beyond_models_vs_models']:13.2f} {row['peak_vs_models']:11.2f}")
    doc = {"command": command_line(__file__, argv),
           "machine": {"cpus": os.cpu_count(), "platform": platform.platform()}, "rows": rows}
    if args.append and args.out.exists():
        old = json.loads(args.out.read_text())
        doc["rows"] = [r for r in old.get("rows", []) if r.get("label") != args.label] + rows
        doc["commands"] = {**old.get("commands", {}), args.label: doc["command"]}
    else:
        doc["commands"] = {args.label: doc["command"]}
    write_results(args.out, doc)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
