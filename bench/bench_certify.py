"""Certificates of weight matching: how far a result is from the optimum, per kind of bound.

For a few pairs: the global decoupled bound (norm-preserving groups only), the per-space
bounds given the others (exact or relaxed, with their gaps), the joint SDP relaxations
(Shor where the lifted size allows, Gram for the residual's star), the brute-force
optimum where it is small enough to enumerate, and seconds. Pairs: a tiny MLP (planted and independent), a tiny layer on
both axes of a square weight (quadratic), the example nanoGPT built in-script (random
weights, default groups and ``--groups perm``), and, when ../shared/data holds Tiny
Shakespeare, two briefly trained character GPTs (bench/trained.py's ``gpt-quick``).

    python -m bench.bench_certify            # writes bench/results/certify.json
"""

from __future__ import annotations

import argparse
import itertools
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from bench.fixtures import DEFAULT_TEXT, RESULTS, ROOT, command_line, write_results
from bench.trained import trained_models
from symspec.alignment import align
from symspec.binding import bind
from symspec.planting import plant
from symspec.spec import loads_spec
from symspec.statedict import squared_distance
from symspec.transforms import apply_elements

MLP_SPEC = """
symspec: 1
name: mlp
dims:
  h: shape("fc1.weight", 0)
  k: shape("fc2.weight", 0)
spaces:
  hid: S(h)
  hid2: S(k)
params:
  fc1.weight: [hid, _]
  fc1.bias: [hid]
  fc2.weight: [hid2, hid*]
  fc2.bias: [hid2]
  fc3.weight: [_, hid2*]
  fc3.bias: invariant
"""

REC_SPEC = """
symspec: 1
name: rec
dims:
  h: shape("fc1.weight", 0)
spaces:
  hid: S(h)
params:
  fc1.weight: [hid, _]
  mix.weight: [hid, hid*]
  fc2.weight: [_, hid*]
"""


class MLP(nn.Module):
    def __init__(self, h: int, k: int, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.fc1, self.fc2, self.fc3 = nn.Linear(3, h), nn.Linear(h, k), nn.Linear(k, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc3(torch.relu(self.fc2(torch.relu(self.fc1(x)))))


class Rec(nn.Module):
    def __init__(self, h: int, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.fc1, self.mix, self.fc2 = nn.Linear(3, h, bias=False), nn.Linear(h, h, bias=False), nn.Linear(h, 2, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.mix(torch.relu(self.fc1(x)))))


def brute(spec: Any, a: nn.Module, b: nn.Module) -> float:
    """min over every element of the permutation spaces (tiny models only)."""
    problem = bind(spec, a).problem
    sa = {k: v.double() for k, v in a.state_dict().items()}
    sb = {k: v.double() for k, v in b.state_dict().items()}
    names = list(problem.spaces)
    best = float("inf")
    for perms in itertools.product(*(itertools.permutations(range(problem.spaces[s].group.n)) for s in names)):
        elems = {s: {"perm": torch.tensor(p)} for s, p in zip(names, perms)}
        best = min(best, squared_distance(sa, apply_elements(problem, elems, sb), problem.params))
    return best


def run(name: str, a: nn.Module, b: nn.Module, spec: Any, groups: str | None = None, optimum: float | None = None) -> dict[str, Any]:
    t0 = time.perf_counter()
    result = align(a, b, spec, groups=groups)
    t_align = time.perf_counter() - t0
    t0 = time.perf_counter()
    cert = result.certify()
    t_cert = time.perf_counter() - t0
    doc: dict[str, Any] = {"pair": name, "groups": groups or "full", "objective": cert.value,
                           "brute_force_optimum": optimum, "align_seconds": round(t_align, 3),
                           "certify_seconds": round(t_cert, 3), "certificate": cert.to_dict()}
    print(f"\n{name} (groups {groups or 'full'}): objective {cert.value:.6g}"
          + (f", brute-force optimum {optimum:.6g}" if optimum is not None else "")
          + f"; align {t_align:.2f} s, certify {t_cert:.2f} s")
    print(f"  decoupled global bound: {cert.bound:.6g}" if cert.available else f"  decoupled global bound: {cert.reason[:110]}")
    for s in cert.per_space:
        gap = "-" if s.gap is None else f"{s.gap:.3g}"
        print(f"  {s.space:9s} {s.group:30s} {s.kind:11s} value {s.value:.6g} bound {s.bound:.6g} gap {gap} "
              f"({s.method}; {s.seconds:.3f} s)")
    for j in cert.joint:
        if j.available:
            found = "" if j.found is None else f"; rounding the relaxation found {j.found:.6g}"
            print(f"  joint SDP {j.scope} over {', '.join(j.spaces)} (Shor N={j.size}, Gram size {j.gram_size}): "
                  f"bound {j.bound:.6g}, value {j.value:.6g}, gap {j.gap:.3g}{' (whole objective)' if j.whole else ''}"
                  f"{found}; {j.seconds:.2f} s")
        else:
            print(f"  joint SDP {j.scope}: {j.reason[:150]}")
    return doc


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=RESULTS / "certify.json")
    p.add_argument("--no-trained", action="store_true", help="skip the trained GPT pair")
    args = p.parse_args(argv)
    warnings.filterwarnings("ignore", message="Solution may be inaccurate")
    torch.set_num_threads(2)
    rows = []
    mlp = loads_spec(MLP_SPEC, "mlp.yaml")
    a = MLP(5, 4, 0)
    rows.append(run("tiny MLP 5+4 units, planted", a, plant(a, mlp, seed=3).model, mlp, optimum=0.0))
    for seed in (0, 2):
        a, b = MLP(5, 4, seed), MLP(5, 4, seed + 1)
        rows.append(run(f"tiny MLP 5+4 units, independent (seeds {seed}, {seed + 1})", a, b, mlp, optimum=brute(mlp, a, b)))
    rec = loads_spec(REC_SPEC, "rec.yaml")
    a, b = Rec(6, 0), Rec(6, 1)
    rows.append(run("square layer on both axes, 6 units, independent", a, b, rec, optimum=brute(rec, a, b)))
    from symspec.loading import import_file
    from symspec.testing import randomize_

    mod = import_file(ROOT / "examples" / "nanogpt.py")

    def gpt(seed: int) -> nn.Module:
        torch.manual_seed(seed)
        m = mod.build(n_layer=2, n_head=2, n_embd=8, n_ff=6, vocab_size=11, block_size=8)
        randomize_(m, seed)
        return m.eval()

    ga, gb = gpt(0), gpt(1)
    rows.append(run("example nanoGPT (2 layers, d 8, 2 heads, 6 units), random weights", ga, gb, "nanogpt"))
    rows.append(run("example nanoGPT (2 layers, d 8, 2 heads, 6 units), random weights", ga, gb, "nanogpt", groups="perm"))
    rows.append(run("example nanoGPT, planted", ga, plant(ga, "nanogpt", seed=5).model, "nanogpt"))
    if not args.no_trained and DEFAULT_TEXT.exists():
        (ta, _), (tb, _) = trained_models("gpt-quick", [0, 1], f"text:{DEFAULT_TEXT}", log=lambda *_: None)
        rows.append(run("character GPT gpt-quick (1 layer, d 16, 2 heads, 32 units), trained", ta, tb, "nanogpt"))
        rows.append(run("character GPT gpt-quick (1 layer, d 16, 2 heads, 32 units), trained", ta, tb, "nanogpt", groups="perm"))
    write_results(args.out, {"command": command_line(__file__, argv), "rows": rows})


if __name__ == "__main__":
    main()
