"""Cost of a K-point interpolation curve, as a multiple of K plain forward passes.

    python -m bench.bench_barrier [--data ../shared/data] [--points 11] [--repeats 3]
                                  [--device cpu] [--out bench/results/barrier.json]

For each case (a character GPT on Tiny Shakespeare, a ViT on MNIST) it compares

- plain: a pass of ``model(x)`` over the split's batches (inference mode), the floor
  any evaluation of K models pays K times;
- a curve point: ``lerp_state`` of the weights into the reused buffers and
  ``PathEvaluator.evaluate`` (``functional_call`` per batch, the loss, the accuracy).

The primary ratio is (K · fastest point + the curve's one-off preparation) / (K ·
fastest plain pass), one plain pass and one point interleaved K · ``--repeats`` times:
on a machine shared with other work, a run of seconds is often disturbed, and the
fastest of many short interleaved samples is the least disturbed estimate (as timeit
advises). The whole ``PathEvaluator.curve`` is also timed against K plain passes,
``--repeats`` times each, interleaved; its best-of and median ratios are recorded too.
Target: 1.2 or less. Also reported: the per-point overhead, the lerp alone, and the
evaluator's setup (module copy, data to the device). Weights are random: the cost does not depend on their values. The data are
read from ``--data`` (default: ../shared/data next to the repository).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from bench.fixtures import RESULTS, ROOT, SHARED, command_line, write_results

DEFAULT_DATA = SHARED


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def plain_passes(model: torch.nn.Module, batches: list[tuple[Any, torch.Tensor]], k: int, device: torch.device) -> float:
    from symspec.data import call_model

    _sync(device)
    start = time.perf_counter()
    with torch.inference_mode():
        for _ in range(k):
            for inputs, _targets in batches:
                call_model(model, inputs)
    _sync(device)
    return time.perf_counter() - start


def run_case(name: str, model_file: Path, build_kw: dict[str, Any], source: str, *, points: int, repeats: int,
             device: str, batch_size: int, max_samples: int | None) -> dict[str, Any]:
    from symspec.analyzers.interpolate import PathEvaluator, lambdas, lerp_state
    from symspec.data import load_data
    from symspec.loading import import_file

    mod = import_file(model_file)
    torch.manual_seed(0)
    a = mod.build(**build_kw).eval()
    torch.manual_seed(1)
    b = mod.build(**build_kw).eval()
    data = load_data(source, model=a, module=mod, split="val", batch_size=batch_size, max_samples=max_samples)
    dev = torch.device(device)

    start = time.perf_counter()
    ev = PathEvaluator(a, data, device=dev)
    _sync(dev)
    setup = time.perf_counter() - start
    plain_model = a.to(dev)  # the plain baseline runs the model itself, on the same device-resident batches
    batches = ev.data.batches
    sd_a, sd_b = dict(a.state_dict()), dict(b.state_dict())

    plain_passes(plain_model, batches, 1, dev)  # warm-up both paths
    ev.curve(sd_a, sd_b, 2)
    grid = lambdas(points)

    # the one-off part of a curve: endpoints to the device and the dtype, buffers
    prep_t = []
    for _ in range(3):
        _sync(dev)
        t0 = time.perf_counter()
        pa, pb = ev.prepare(sd_a), ev.prepare(sd_b)
        buf = {k: torch.empty_like(v) if v.is_floating_point() else v for k, v in pa.items()}
        _sync(dev)
        prep_t.append(time.perf_counter() - t0)

    # fine-grained, interleaved: one plain pass, one curve point
    plain_1, point_1, lerp_1 = [], [], []
    for i in range(points * repeats):
        plain_1.append(plain_passes(plain_model, batches, 1, dev))
        _sync(dev)
        t0 = time.perf_counter()
        lerp_state(pa, pb, grid[i % points], out=buf)
        _sync(dev)
        t1 = time.perf_counter()
        ev.evaluate(buf, prepared=True)
        _sync(dev)
        point_1.append(time.perf_counter() - t0)
        lerp_1.append(t1 - t0)

    # coarse: whole curves against K plain passes
    plain_t, curve_t = [], []
    for _ in range(repeats):
        plain_t.append(plain_passes(plain_model, batches, points, dev))
        _sync(dev)
        t0 = time.perf_counter()
        curve = ev.curve(sd_a, sd_b, points)
        _sync(dev)
        curve_t.append(time.perf_counter() - t0)

    plain_best, point_best = min(plain_1), min(point_1)
    ratio = (points * point_best + min(prep_t)) / (points * plain_best)

    def quartile(v: list[float]) -> float:
        return sorted(v)[len(v) // 4]

    ratio_q1 = (points * quartile(point_1) + min(prep_t)) / (points * quartile(plain_1))
    n_params = sum(p.numel() for p in a.parameters())
    return {
        "case": name,
        "model": f"{model_file.name} {build_kw}",
        "parameters": n_params,
        "data": data.describe(),
        "device": str(dev),
        "points": points,
        "repeats": repeats,
        "forward_passes": points * len(batches),
        "ratio": ratio,
        "ratio_lower_quartile": ratio_q1,
        "target": 1.2,
        "within_target": ratio <= 1.2,
        "plain_pass_best_s": plain_best,
        "curve_point_best_s": point_best,
        "prepare_best_s": min(prep_t),
        "samples": points * repeats,
        "overhead_per_point_ms": (point_best - plain_best) * 1e3,
        "lerp_per_point_ms": min(lerp_1) * 1e3,
        "whole_curve": {"plain_s": plain_t, "curve_s": curve_t,
                        "ratio_best": min(curve_t) / min(plain_t),
                        "ratio_of_medians": statistics.median(curve_t) / statistics.median(plain_t)},
        "setup_s": setup,
        "barrier_random_init": max(lv - ((1 - t) * curve.losses[0] + t * curve.losses[-1])
                                   for t, lv in zip(curve.lambdas, curve.losses)),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", type=Path, default=DEFAULT_DATA, help="folder with tinyshakespeare.txt and mnist/ (default: %(default)s)")
    ap.add_argument("--points", type=int, default=11)
    ap.add_argument("--repeats", type=int, default=3,
                    help="whole curves per path; the interleaved per-point samples are K times as many")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch CPU threads (default 1: on a shared 2-core machine, 2 threads made every op wait "
                         "~10 ms for the other core; the ratio, not the absolute time, is what this measures)")
    ap.add_argument("--text-samples", type=int, default=256, help="validation windows of Tiny Shakespeare (context 64)")
    ap.add_argument("--image-samples", type=int, default=1000, help="validation images of MNIST")
    ap.add_argument("--quick", action="store_true", help="tiny sizes, for a smoke test")
    ap.add_argument("--out", type=Path, default=RESULTS / "barrier.json")
    args = ap.parse_args(argv)
    if args.points < 2:
        ap.error("--points must be at least 2")
    if args.threads < 1:
        ap.error("--threads must be at least 1")
    torch.set_num_threads(args.threads)

    text = args.data / "tinyshakespeare.txt"
    mnist = args.data / "mnist"
    missing = [p for p in (text, mnist / "t10k-images-idx3-ubyte.gz") if not p.exists()]
    if missing:
        print(f"error: missing data: {', '.join(map(str, missing))}; pass --data PATH (a folder with "
              "tinyshakespeare.txt and mnist/)", file=sys.stderr)
        return 2
    text_n, image_n = (32, 128) if args.quick else (args.text_samples, args.image_samples)
    repeats = 1 if args.quick else args.repeats
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), device {args.device}, K = {args.points}, "
          f"{repeats} repeat(s)")
    examples = ROOT / "examples"
    cases = [
        ("gpt-tinyshakespeare", examples / "nanogpt.py", {"n_layer": 2, "n_head": 4, "n_embd": 64, "block_size": 64, "vocab_size": 65},
         f"text:{text}", 64, text_n),
        ("vit-mnist", examples / "vit.py", {"n_layer": 2, "n_head": 4, "n_embd": 64, "image_size": 28, "patch_size": 7},
         f"mnist:{mnist}", 250, image_n),
    ]
    results = []
    print(f"{'case':<22} {'device':<6} {'K':>3} {'passes':>6} {'pass ms':>8} {'point ms':>8} {'ratio':>6} {'(q1)':>6} "
          f"{'curve best':>10} {'curve med':>9} {'/point ms':>9} {'lerp ms':>8} {'setup s':>8}")
    for name, mf, kw, source, bs, n in cases:
        r = run_case(name, mf, kw, source, points=args.points, repeats=repeats, device=args.device,
                     batch_size=bs, max_samples=n)
        results.append(r)
        w = r["whole_curve"]
        print(f"{name:<22} {r['device']:<6} {r['points']:>3} {r['forward_passes']:>6} {r['plain_pass_best_s'] * 1e3:>8.1f} "
              f"{r['curve_point_best_s'] * 1e3:>8.1f} {r['ratio']:>6.3f} {r['ratio_lower_quartile']:>6.3f} {w['ratio_best']:>10.3f} {w['ratio_of_medians']:>9.3f} "
              f"{r['overhead_per_point_ms']:>9.2f} {r['lerp_per_point_ms']:>8.3f} {r['setup_s']:>8.3f}", flush=True)
    doc = {
        "schema": "symspec.bench.barrier/1",
        "command": command_line(__file__, argv),
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": {"platform": platform.platform(), "python": platform.python_version(), "torch": torch.__version__,
                    "cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(),
                    "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None},
        "quick": args.quick,
        "cases": results,
        "all_within_target": all(r["within_target"] for r in results),
    }
    write_results(args.out, doc)
    ratios = ", ".join(f"{r['case']} {r['ratio']:.3f}" for r in results)
    verdict = "met" if doc["all_within_target"] else "NOT met"
    print(f"ratio target 1.2: {verdict} ({ratios})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
