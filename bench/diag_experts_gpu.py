"""Which space weight matching leaves off on a planted Mixtral, per device (a diagnosis
of bench_experts.py's CUDA rows): the objective history and, per space, whether the
element found maps B onto A.

    python bench/diag_experts_gpu.py [--size 256x8x256] [--devices cuda cpu]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench_experts beside it; symspec as installed


def main() -> None:
    import torch
    from bench_experts import planted

    import symspec

    ap = argparse.ArgumentParser()
    ap.add_argument("--size", default="256x8x256")
    ap.add_argument("--devices", nargs="+", default=["cuda", "cpu"])
    ap.add_argument("--layers", type=int, default=2)
    args = ap.parse_args()
    d, n_exp, f = (int(x) for x in args.size.split("x"))
    a, b = planted(d, n_exp, f, args.layers)
    print("tf32 matmul:", torch.backends.cuda.matmul.allow_tf32, "precision:", torch.get_float32_matmul_precision())
    for dev in args.devices:
        if dev == "cuda" and not torch.cuda.is_available():
            continue
        res = symspec.align(a, b, "mixtral", rounds=20, tol=1e-10, device=dev)
        sd = a.state_dict()
        print(dev, "history", [f"{h:.3e}" for h in res.history])
        for p in res.bound.problem.params:
            err = float((res.aligned_b[p].double().cpu() - sd[p].double()).norm() / sd[p].double().norm().clamp_min(1e-30))
            if err > 1e-5:
                print(f"  {p}: relative error {err:.2e}")


if __name__ == "__main__":
    main()
