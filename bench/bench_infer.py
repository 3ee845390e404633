"""Wall time of ``symspec infer`` (trace, read the graph, draft, check) on GPT-2-small-
and Llama-125M-shaped models.

    python -m bench.bench_infer [--cases gpt2-small,llama-125m] [--samples 2] [--dtypes float64,float32]
                                [--out bench/results/infer.json]

The models are those of bench/bench_check.py (random weights from a config; nothing
downloads), each measured in a fresh subprocess. The time is split into its phases:
``export+read`` (torch.export and the walk over the graph), ``draft`` (spaces, bindings,
folds) and ``render+check`` (the YAML, and the check of the draft with any rechecks after a
shrink); ``rounds`` counts the checks.
Target: both cases together under 60 s on 2 CPU cores. The inferred spec is also
compared with the built-in one for the family (the same spaces and groups on every
parameter axis, as tests/test_infer.py compares them).

    python -m bench.bench_infer --families [--out bench/results/infer_families.json]

times inference per family of the inference zoo (tests/infer_zoo.py: the tiny models of
the architectures symspec ships no spec for) and of the encoder-decoders T5, BART and
Whisper (tests/test_infer.py), each in a fresh subprocess, with the groups found and,
for the zoo, whether they are the ones its test expects.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.bench_check import CASES, build
from bench.fixtures import RESULTS, ROOT, command_line, module_command, write_results


def measure(case: str, samples: int, dtypes: list[str]) -> dict[str, Any]:
    import torch

    import symspec
    from symspec.inference import api
    from tests.test_infer import signature

    model, inputs = build(case)
    phases: dict[str, float] = {}
    real_read, real_build = api.read_model, api.build

    def timed_read(m: Any, x: Any) -> Any:
        t = time.perf_counter()
        facts = real_read(m, x)
        phases["export+read"] = phases.get("export+read", 0.0) + time.perf_counter() - t
        return facts

    def timed_build(*a: Any, **k: Any) -> Any:
        t = time.perf_counter()
        d = real_build(*a, **k)
        phases["draft"] = phases.get("draft", 0.0) + time.perf_counter() - t
        return d

    api.read_model, api.build = timed_read, timed_build
    t0 = time.perf_counter()
    result = api.infer(model, inputs, samples=samples, dtypes=tuple(dtypes))
    wall = time.perf_counter() - t0
    api.read_model, api.build = real_read, real_build
    t = time.perf_counter()
    from symspec.graph import trace

    trace(model, inputs, methods=("export",))
    export_only = time.perf_counter() - t
    same = signature(result.spec, model) == signature(symspec.load_spec(CASES[case]["spec"]), model)
    return {
        "case": case,
        "wall_s": round(wall, 2),
        "export_s (measured again alone)": round(export_only, 2),
        "export+read_s": round(phases.get("export+read", 0.0), 2),
        "draft_s": round(phases.get("draft", 0.0), 2),
        "render+check_s": round(wall - phases.get("export+read", 0.0) - phases.get("draft", 0.0), 2),
        "rounds": result.attempts,
        "passed": result.passed,
        "spaces": {s.name: s.group for s in result.spaces},
        "same_as_builtin": same,
        "samples": samples,
        "dtypes": dtypes,
        "threads": torch.get_num_threads(),
        "load_avg_1m": round(os.getloadavg()[0], 2),
    }


ENCODER_DECODERS = ("t5", "bart", "whisper")


def family_names() -> list[str]:
    from tests.infer_zoo import NEW

    return [*NEW, *ENCODER_DECODERS]


def measure_family(name: str, samples: int) -> dict[str, Any]:
    """``infer`` on one tiny family model: wall time, rounds, the groups found."""
    import torch

    from symspec.inference import infer
    from symspec.loading.hf import hf_example_inputs
    from tests.infer_zoo import NEW

    if name in NEW:
        build_fn, want = NEW[name]
        model, inputs = build_fn()
    else:
        from tests.test_infer import _encoder_decoder

        model, want = _encoder_decoder(name), None
        inputs = hf_example_inputs(model)
    t0 = time.perf_counter()
    result = infer(model, inputs, samples=samples)
    wall = time.perf_counter() - t0
    found = {s.name.replace("[i]", ""): s.group for s in result.spaces}
    return {"family": name, "wall_s": round(wall, 2), "rounds": result.attempts, "passed": result.passed,
            "verified": result.verified, "spaces": found, "as_expected": (found == want) if want is not None else None,
            "params": sum(p.numel() for p in model.parameters()), "samples": samples,
            "threads": torch.get_num_threads(), "load_avg_1m": round(os.getloadavg()[0], 2)}


def _in_child(*flags: str) -> dict[str, Any] | None:
    """This script with ``flags`` (one measurement) in a fresh process: its JSON row, or
    None when it failed (its stderr printed)."""
    out = subprocess.run([*module_command(__file__), *flags], capture_output=True, text=True, cwd=ROOT,
                         env={**os.environ, "PYTHONWARNINGS": "ignore"})
    if out.returncode:
        print(out.stderr, file=sys.stderr)
        return None
    row: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return row


def run_families(args: argparse.Namespace, argv: list[str] | None) -> int:
    runs = []
    for name in family_names():
        r = _in_child("--one-family", name, "--samples", str(args.samples))
        if r is None:
            return 1
        runs.append(r)
        print(f"{name:<22} {r['wall_s']:>6.1f} s in {r['rounds']} round(s)  verified={r['verified']}  "
              f"as expected={r['as_expected']}  {', '.join(f'{k}: {v}' for k, v in r['spaces'].items())}", flush=True)
    write_results(Path(args.out or RESULTS / "infer_families.json"), {
        "benchmark": "symspec infer per family: the inference zoo and the encoder-decoders (tiny random models)",
        "command": command_line(__file__, argv),
        "machine": {"cpus": os.cpu_count()},
        "total_s": round(sum(r["wall_s"] for r in runs), 2),
        "runs": runs,
    })
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--samples", type=int, default=2)
    ap.add_argument("--dtypes", default="float64,float32")
    ap.add_argument("--out", help="default: bench/results/infer.json (--families: infer_families.json)")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    ap.add_argument("--families", action="store_true", help="time inference per family of the inference zoo "
                    "and the encoder-decoders (bench/results/infer_families.json)")
    ap.add_argument("--one-family", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    dtypes = args.dtypes.split(",")
    if args.one_family:
        print(json.dumps(measure_family(args.one_family, args.samples)))
        return 0
    if args.families:
        return run_families(args, argv)
    if args.one:
        print(json.dumps(measure(args.one, args.samples, dtypes)))
        return 0
    runs = []
    for case in args.cases.split(","):
        r = _in_child("--one", case, "--samples", str(args.samples), "--dtypes", args.dtypes)
        if r is None:
            return 1
        runs.append(r)
        print(f"{case:<11} {r['wall_s']:>6.1f} s  (export+read {r['export+read_s']:.1f} s, draft {r['draft_s']:.1f} s, "
              f"render+check {r['render+check_s']:.1f} s in {r['rounds']} round(s))  passed={r['passed']}  same as built-in={r['same_as_builtin']}",
              flush=True)
    total = sum(r["wall_s"] for r in runs)
    print(f"total {total:.1f} s (target: under 60 s for gpt2-small and llama-125m together on 2 cores)")
    write_results(Path(args.out or RESULTS / "infer.json"), {
        "benchmark": "symspec infer (symspec.inference.infer): trace, read, draft, check",
        "command": command_line(__file__, argv),
        "machine": {"cpus": os.cpu_count()},
        "target": {"total_s": 60, "met": total < 60 if len(runs) == len(CASES) else None},
        "total_s": round(total, 2),
        "runs": runs,
    })
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
