"""Weight and learned matching on the GPU against the CPU, in one run, with planted recovery.

    python -m bench.bench_gpu [--cases gpt2-small qwen2-0.5b experts-256] [--methods weight learned]
                              [--steps 20] [--out bench/results/gpu.json]
    python -m bench.bench_gpu --cpu-only --quick      # the CPU half on tiny shapes (no GPU needed)
    bash bench/gpu.sh OUT_DIR                         # what a lent GPU runs, in one call

Each case is a float32 model of a real shape with random weights (``bench.bench_scale``'s
shapes; ``experts-*``: the planted Mixtral of ``bench.bench_experts``) and B = g·A, a
planted copy (``symspec.plant``, seed 3). For each method and device, ``symspec.align``
aligns B to A and the row records the wall time (the device synchronised), the rounds or
steps, and for weight matching the planted recovery ||canonical A - aligned B|| /
||canonical A|| over the spec's parameters (float64). The GPU should recover the planted
element to the CPU's precision: ``recovery_vs_cpu`` is the GPU's recovery over the
CPU's, per case.

The CPU half of a large case can run fewer rounds or steps than the GPU's
(``--cpu-rounds``, ``--cpu-steps``: a per-round or per-step time is then the comparison);
cases run smallest first, and the results file is rewritten after every row, so a run
stopped by its time limit keeps what it measured. ``--tf32`` adds a row per weight-matching
case with TF32 matmuls allowed (``torch.set_float32_matmul_precision("high")``): what the
solver's precision guard is there for. Without CUDA (and without ``--cpu-only``) it prints
"no CUDA" and exits 0.
"""

from __future__ import annotations

import argparse
import platform
import time
import traceback
from pathlib import Path
from typing import Any

import torch

import symspec
from bench.bench_experts import planted as planted_experts
from bench.bench_scale import SHAPES, build, tokenizer_file
from bench.fixtures import DEFAULT_TEXT, RESULTS, ROOT, command_line, write_results
from symspec.alignment import method_names

CACHE = ROOT / "bench" / "cache" / "gpu"

#: case -> (shape of bench_scale, or "experts:d x E x f"); the quick cases are tiny
CASES = {"gpt2-small": "gpt2-small", "qwen2-0.5b": "qwen2-0.5b", "experts-256": "experts:256x8x256",
         "gpt2-tiny": "gpt2-tiny", "qwen2-tiny": "qwen2-tiny", "experts-16": "experts:16x4x8"}
FULL = ["experts-256", "gpt2-small", "qwen2-0.5b"]
QUICK = ["experts-16", "gpt2-tiny", "qwen2-tiny"]


def pair(case: str) -> tuple[Any, Any, str]:
    """A (float32) and B = g·A, and the spec's name."""
    shape = CASES[case]
    if shape.startswith("experts:"):
        d, n_exp, f = (int(x) for x in shape.split(":")[1].split("x"))
        a, b = planted_experts(d, n_exp, f, 1)
        return a, b, "mixtral"
    spec = SHAPES[shape][0]
    a = build(shape, 0)
    return a, symspec.plant(a, spec, seed=3).model, spec


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def recovery(res: Any) -> float:
    """||canonical A - aligned B|| / ||canonical A|| over the spec's parameters (float64)."""
    params = res.bound.problem.params
    den = sum(float(res.canonical_a[p].double().square().sum()) for p in params)
    return (res.distance("aligned") / den) ** 0.5


def text_data(model: Any, text: Path, block: int, batch: int) -> tuple[Any, Any]:
    """Train and validation windows of ``text`` (a byte-level BPE of 512 tokens trained on it)."""
    from symspec.data import load_data

    src = f"text:{text},block={block},tokenizer={tokenizer_file(cache=CACHE, text=text)}"
    train = load_data(src, model=model, split="train", batch_size=batch, max_samples=64 * batch)
    val = load_data(src, model=model, split="val", batch_size=batch, max_samples=4 * batch)
    return train, val


def one(case: str, method: str, device: str, a: Any, b: Any, spec: str, args: argparse.Namespace,
        tf32: bool = False) -> dict[str, Any]:
    from symspec.learned import LearnedOptions

    cpu = device == "cpu"
    rounds = (args.cpu_rounds if cpu and case in args.large and args.cpu_rounds else args.rounds)
    steps = (args.cpu_steps if cpu and case in args.large and args.cpu_steps else args.steps)
    kw: dict[str, Any] = {"rounds": rounds, "tol": args.tol, "device": device}
    if method == "learned":
        kw["data"], kw["validation"] = text_data(a, args.text, args.block, args.batch_size)
        kw["options"] = LearnedOptions(steps=steps, eval_every=max(1, steps // 2), val_batches=2)
    before = torch.get_float32_matmul_precision()
    if tf32:
        torch.set_float32_matmul_precision("high")
    try:
        sync(device)
        t = time.perf_counter()
        res = symspec.align(a, b, spec, method=method, **kw)
        sync(device)
        seconds = time.perf_counter() - t
    finally:
        torch.set_float32_matmul_precision(before)
    row: dict[str, Any] = {"case": case, "method": method, "device": device + ("+tf32" if tf32 else ""),
                           "shortened": cpu and case in args.large,
                           "seconds": round(seconds, 3), "rounds": len(res.history) - 1 if res.history else None}
    if method == "weight":
        row["recovery"] = recovery(res)
        row["seconds_per_round"] = round(seconds / max(1, row["rounds"] or 1), 3)
    else:
        row["steps"] = steps
        row["seconds_per_step"] = round(seconds / steps, 3)
        info = res.info.get("info", res.info)
        row["best_val_midpoint_loss"] = info.get("best_val_midpoint_loss") if isinstance(info, dict) else None
    print(f"{case:>12} {method:>8} {row['device']:>10}: {seconds:8.2f} s"
          + (f", recovery {row['recovery']:.2e} after {row['rounds']} round(s)" if "recovery" in row else
             f", {row['seconds_per_step']:.3f} s/step"), flush=True)
    return row


def guarded(case: str, method: str, device: str, a: Any, b: Any, spec: str, args: argparse.Namespace,
            tf32: bool) -> dict[str, Any]:
    """:func:`one`, or a row with the error (the GPU path is what is under test: one case's
    failure must not lose the others' rows)."""
    try:
        return one(case, method, device, a, b, spec, args, tf32)
    except Exception as e:  # reported in the row and on stderr, and the run goes on
        traceback.print_exc()
        print(f"{case:>12} {method:>8} {device:>10}: failed: {type(e).__name__}: {e}", flush=True)
        return {"case": case, "method": method, "device": device + ("+tf32" if tf32 else ""),
                "error": f"{type(e).__name__}: {e}"[:2000]}
    finally:
        if device.startswith("cuda"):
            torch.cuda.empty_cache()


def compare(rows: list[dict[str, Any]]) -> None:
    """Each GPU weight-matching row gets its recovery over the CPU's (same case, full rounds)."""
    cpu = {r["case"]: r["recovery"] for r in rows if r["device"] == "cpu" and "recovery" in r and not r.get("shortened")}
    for r in rows:
        if r["device"] != "cpu" and "recovery" in r and cpu.get(r["case"]):
            r["recovery_vs_cpu"] = r["recovery"] / cpu[r["case"]]


def machine() -> dict[str, Any]:
    cuda = torch.cuda.is_available()
    return {"python": platform.python_version(), "torch": torch.__version__, "threads": torch.get_num_threads(),
            "gpu": torch.cuda.get_device_name(0) if cuda else None,
            "float32_matmul_precision": torch.get_float32_matmul_precision(),
            "cuda_matmul_allow_tf32": torch.backends.cuda.matmul.allow_tf32,
            "cudnn_allow_tf32": torch.backends.cudnn.allow_tf32}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", nargs="+", choices=list(CASES), default=None, help=f"default: {' '.join(FULL)}")
    ap.add_argument("--methods", nargs="+", choices=["weight", "learned"], default=["weight", "learned"])
    ap.add_argument("--quick", action="store_true", help=f"tiny cases ({' '.join(QUICK)})")
    ap.add_argument("--cpu-only", action="store_true", help="run the CPU half only (no GPU needed)")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--tol", type=float, default=1e-10)
    ap.add_argument("--steps", type=int, default=20, help="learned matching's steps")
    ap.add_argument("--large", nargs="*", default=["qwen2-0.5b"], help="cases whose CPU half is shortened")
    ap.add_argument("--cpu-rounds", type=int, default=2, help="weight matching rounds on the CPU for --large cases")
    ap.add_argument("--cpu-steps", type=int, default=4, help="learned steps on the CPU for --large cases")
    ap.add_argument("--block", type=int, default=128)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--text", type=Path, default=DEFAULT_TEXT,
                    help="learned matching's text (a GPU machine has no ../shared: gpu.sh copies it into bench/cache/gpu)")
    ap.add_argument("--tf32", action="store_true", help="also run weight matching on the GPU with TF32 allowed")
    ap.add_argument("--out", type=Path, default=RESULTS / "gpu.json")
    args = ap.parse_args(argv)
    if not args.cpu_only and not torch.cuda.is_available():
        print("no CUDA: nothing to compare on this machine (run with --cpu-only for the CPU half)")
        return 0
    devices = ["cpu"] if args.cpu_only else ["cuda", "cpu"]  # the GPU's row first: a time limit cuts the CPU's
    if "learned" not in method_names():  # symspec not installed (a bare GPU machine): no entry points
        import symspec.learned.extension  # noqa: F401  registers learned matching
    doc: dict[str, Any] = {"benchmark": "weight and learned matching, CPU against GPU, planted pairs",
                           "command": command_line(__file__, argv), "machine": machine(), "rows": []}
    for case in args.cases or (QUICK if args.quick else FULL):
        a, b, spec = pair(case)
        for method in args.methods:
            if method == "learned" and spec == "mixtral":
                continue  # its vocabulary (97) is below the text's tokenizer's
            runs = [(device, False) for device in devices]
            if method == "weight" and args.tf32 and "cuda" in devices:
                runs.append(("cuda", True))
            for device, tf32 in runs:
                doc["rows"].append(guarded(case, method, device, a, b, spec, args, tf32))
                compare(doc["rows"])
                write_results(args.out, doc)
        del a, b
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
