"""Weight matching on mixtures of experts: planted recovery and speed, on the CPU and, when
there is one, the GPU.

    python -m bench.bench_experts [--sizes 16x4x8 64x8x64 256x8x256] [--layers 2]
                                  [--head-width 64] [--devices cpu cuda]
                                  [--out bench/results/experts.json]

A size is d x E x f: a Mixtral (hidden size d, E experts of f units, heads of width
--head-width (d / width of them, at least 4), half as many key/value heads) with random
weights; B is A moved by a random element of the spec's groups (every
expert permuted with the router, each expert's units permuted, each up path scaled,
the residual rotated, the heads mapped). Weight matching B onto A should find A again:
the relative distance ||A - g.B|| / ||A|| after matching, the rounds it took and the
seconds, per device. The expert + unit + scaling solve reads a dense score over the
E*f units (E^2 f^2 numbers), which is what grows fastest.

On an H200 the GPU once stopped at 4.9e-5 (256x8x256) where the CPU reached 2.5e-6: TF32
was off (and TF32 products, emulated on the CPU, stop 10x further off still); the residual's
rotation came from a float32 SVD on the GPU, now a float64 one (docs/matching.md).
``bash bench/gpu.sh`` measures CPU and GPU side by side.

Wide heads (``--head-width 256``) once stalled: torch's batched LU on a multi-threaded
CPU returns wrong inverses for matrices from about 150 wide (pytorch/pytorch#142815),
and the GL head maps are inverted as a batch; :mod:`symspec.linalg` now inverts such
batches one matrix at a time.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from bench.fixtures import RESULTS, command_line, write_results
from symspec.precision import tf32_setting


def planted(d: int, n_exp: int, f: int, layers: int, head_width: int = 64, seed: int = 0) -> tuple[Any, Any]:
    import torch
    import transformers

    import symspec
    from symspec.binding import bind
    from symspec.transforms import apply_elements, canonicalize_model, sample_elements

    heads = max(4, d // head_width)
    cfg = transformers.MixtralConfig(num_hidden_layers=layers, hidden_size=d, num_attention_heads=heads, num_key_value_heads=heads // 2,
                                     intermediate_size=f, vocab_size=97, num_local_experts=n_exp, num_experts_per_tok=2,
                                     max_position_embeddings=64, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = transformers.MixtralForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.2 * torch.randn_like(p) * (p.std() if p.numel() > 1 and p.std() > 0 else 1.0))
    bound = bind(symspec.load_spec("mixtral"), model)
    a = canonicalize_model(bound, model)
    g = sample_elements(bound.problem, seed=seed + 17, cond=3.0)
    b = canonicalize_model(bound, model)
    b.load_state_dict(apply_elements(bound.problem, g, {k: v.detach() for k, v in a.state_dict().items()}))
    return a, b


def run(size: str, layers: int, device: str, head_width: int = 64) -> dict[str, Any]:
    import torch

    import symspec

    d, n_exp, f = (int(x) for x in size.split("x"))
    a, b = planted(d, n_exp, f, layers, head_width)
    if device == "cuda":
        torch.cuda.synchronize()
    t = time.perf_counter()
    res = symspec.align(a, b, "mixtral", rounds=20, tol=1e-10, device=device)
    if device == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t
    sd = a.state_dict()
    params = res.bound.problem.params
    num = sum(float((res.aligned_b[k].double().cpu() - sd[k].double()).square().sum()) for k in params)
    den = sum(float(sd[k].double().square().sum()) for k in params)
    heads = a.config.num_attention_heads
    row = {"size": size, "d": d, "experts": n_exp, "f": f, "layers": layers, "heads": heads, "head_width": d // heads,
           "device": device,
           "relative_distance": (num / den) ** 0.5, "rounds": len(res.history) - 1, "seconds": seconds,
           "timings": {k: v for k, v in sorted(res.timings.items(), key=lambda kv: -kv[1])[:6]}}
    print(f"{size:>12} {device:>5}: relative distance {row['relative_distance']:.2e} after {row['rounds']} round(s), "
          f"{seconds:.2f} s", flush=True)
    return row


def main(argv: list[str] | None = None) -> None:
    import torch

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", nargs="+", default=["16x4x8", "64x8x64", "256x8x256"])
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--head-width", type=int, default=64, help="attention head width (d / width heads, at least 4)")
    ap.add_argument("--devices", nargs="+", default=["cpu", "cuda"])
    ap.add_argument("--out", type=Path, default=RESULTS / "experts.json")
    args = ap.parse_args(argv)
    devices = [dv for dv in args.devices if dv != "cuda" or torch.cuda.is_available()]
    rows = [run(size, args.layers, dv, args.head_width) for size in args.sizes for dv in devices]
    write_results(args.out, {"benchmark": "planted mixture-of-experts recovery by weight matching",
                             "command": command_line(__file__, argv),
                             "torch": torch.__version__,
                             "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
                             # the caller's setting; weight matching runs in IEEE float32 whatever it is
                             "tf32": tf32_setting(), "rows": rows})


if __name__ == "__main__":
    main()
