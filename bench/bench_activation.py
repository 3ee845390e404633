"""Activation matching's statistics pass: time, statistics size and peak memory vs batches.

    python bench/bench_activation.py [--cases tiny,small] [--batches 2,8,32] [--batch-size 8]
                                     [--rounds 3] [--out bench/results/activation.json]

Model pairs are nanoGPT models (examples/nanogpt.py, spec ``nanogpt``; the sizes of
bench/bench_match.py), ``related`` pairs (B = g.A + noise), float32; the data are random
token batches of ``--batch-size`` sequences of the model's context (tiny: 64, small: 256
tokens). Each case runs ``symspec.align(..., method="activation")`` in a fresh
subprocess, reading ``--batches`` batches, and reports: seconds of the statistics pass
(both models over every batch, moments accumulated), of the factorisation and of the
descent; the statistics' size (float64 moments, fixed by the sites' widths); what
keeping the activations would take instead (tokens x features of every site, both
models, float32); and the peak resident memory over the process before the models were
built. What should hold (measured, never asserted): the statistics' size and the peak
memory do not grow with the batches; the statistics pass grows linearly with them.
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

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

from bench_match import SIZES, _build_pair, _reset_peak, _status_kb  # noqa: E402

CONTEXT = {"tiny": 64, "small": 256}


def run_case(case: str, batches: int, batch_size: int, rounds: int) -> dict[str, Any]:
    import torch

    import symspec
    from symspec.process import configure_process

    configure_process()
    config = dict(SIZES[case], block_size=CONTEXT.get(case, 64))
    base = _status_kb("VmRSS")
    a, b = _build_pair(config, "related")
    gen = torch.Generator().manual_seed(0)
    data = type("Data", (), {})()
    data.batches = [(torch.randint(0, config["vocab_size"], (batch_size, config["block_size"]), generator=gen), None)
                    for _ in range(batches)]
    models = _status_kb("VmRSS")
    _reset_peak()
    from symspec.alignment.activation import ActivationOptions

    t = time.perf_counter()
    res = symspec.align(a, b, "nanogpt", method="activation", data=data, rounds=rounds, tol=0.0,
                        options=ActivationOptions(batches=None))
    wall = time.perf_counter() - t
    stats = res.info["statistics"]
    return {
        "case": case, "batches": batches, "batch_size": batch_size, "tokens": stats["tokens"],
        "sites": stats["sites"], "statistics_bytes": stats["bytes"],
        "seconds": {"statistics": res.timings.get("statistics", 0.0), "factor": res.timings.get("factor", 0.0),
                    "total": wall},
        "objective": res.history, "peak_growth_mb": (_status_kb("VmHWM") - base) / 1024,
        "models_mb": (models - base) / 1024, "site_features": stats["features"],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", default="tiny,small")
    p.add_argument("--batches", default="2,8,32")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "activation.json")
    p.add_argument("--case", help=argparse.SUPPRESS)  # one case in this process: CASE:BATCHES
    args = p.parse_args(argv)
    if args.case:
        case, n = args.case.split(":")
        print(json.dumps(run_case(case, int(n), args.batch_size, args.rounds)))
        return 0
    rows = []
    print(f"{'case':6} {'batches':>7} {'tokens':>8} {'stats s':>8} {'factor s':>8} {'total s':>8} "
          f"{'stats MB':>9} {'acts MB':>9} {'peak MB':>8}")
    for case in args.cases.split(","):
        for n in [int(x) for x in args.batches.split(",")]:
            cmd = [sys.executable, __file__, "--case", f"{case}:{n}", "--batch-size", str(args.batch_size),
                   "--rounds", str(args.rounds)]
            load = os.getloadavg()[0]
            out = subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=ROOT).stdout
            row = json.loads(out.strip().splitlines()[-1]) | {"load_average": load}
            # what keeping the activations would cost: every site's features, both models, float32
            width = row.pop("site_features")
            row["activations_bytes"] = 2 * 4 * row["tokens"] * width
            rows.append(row)
            acts = f"{row['activations_bytes'] / 2**20:9.1f}"
            print(f"{case:6} {n:7d} {row['tokens']:8d} {row['seconds']['statistics']:8.2f} "
                  f"{row['seconds']['factor']:8.2f} {row['seconds']['total']:8.2f} "
                  f"{row['statistics_bytes'] / 2**20:9.1f} {acts:>9} {row['peak_growth_mb']:8.1f}")
    doc = {"command": "python bench/bench_activation.py " + " ".join(argv if argv is not None else sys.argv[1:]),
           "machine": {"cpus": os.cpu_count(), "platform": platform.platform()}, "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
