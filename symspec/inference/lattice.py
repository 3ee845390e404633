"""The groups inference can propose for a class, from what the graph does to it.

Plain classes take one of GL ⊃ O ⊃ {OC, SP} ⊃ S ⊃ Id (OC ∧ SP = S):

- nothing but linear maps: GL (every invertible map, undone by the layers that read it);
- an RMS norm (a sum of squares over the axis): O;
- a LayerNorm (a mean and a variance over the axis), a constant added to every entry: OC
  (orthogonal maps that fix the all-ones direction);
- an odd elementwise function (tanh): SP (signed permutations);
- any other elementwise nonlinearity, a product of two features, a softmax, another
  reduction, a top-k: S;
- a model input or output, an index, a kernel, a constant table added or multiplied
  along the axis, rows picked along it by data, an op inference cannot read: Id (the
  axis stays as it is).
"""

from __future__ import annotations

from collections.abc import Iterable

ORDER = ("GL", "O", "OC", "SP", "S", "Id")
_BELOW = {
    "GL": {"GL", "O", "OC", "SP", "S", "Id"},
    "O": {"O", "OC", "SP", "S", "Id"},
    "OC": {"OC", "S", "Id"},
    "SP": {"SP", "S", "Id"},
    "S": {"S", "Id"},
    "Id": {"Id"},
}
#: what the shrinking tries after a group fails its check (the next smaller groups inference can justify)
SHRINK = {"GL": ["O", "S", "Id"], "O": ["SP", "S", "Id"], "OC": ["S", "Id"], "SP": ["S", "Id"], "S": ["Id"], "Id": []}
#: the next larger group of each (what a test shows fails)
LARGER = {"O": "GL", "OC": "O", "SP": "O", "S": "SP", "D": "GL", "Dpos": "D", "RoPE": "GL"}


def leq(a: str, b: str) -> bool:
    return a in _BELOW[b]


def meet(a: str, b: str) -> str:
    common = _BELOW[a] & _BELOW[b]
    return next(g for g in ORDER if g in common)


def largest(tags: Iterable[str]) -> tuple[str, list[str]]:
    """The largest group the tags allow, and why (one phrase per constraint)."""
    g = "GL"
    caps: list[tuple[str, str]] = []

    def cap(to: str, reason: str) -> None:
        nonlocal g
        g = meet(g, to)
        caps.append((to, reason))

    tags = set(tags)
    for t in sorted(tags):
        if t in ("observable", "data", "index", "kernel", "buffer"):
            cap("Id", {"observable": "an output of the model", "data": "an axis of the input data",
                       "index": "an embedding's vocabulary", "kernel": "a convolution kernel",
                       "buffer": "a buffer (the spec moves parameters only)"}[t])
        elif t.startswith("opaque"):
            cap("Id", f"an op inference cannot read ({t.split(':', 1)[1]})")
        elif t == "constadd":
            cap("Id", "a fixed table added along it")
        elif t == "varying":
            cap("Id", "multiplied by a fixed table along it")
        elif t == "gather":
            cap("Id", "rows picked along it by data (an index)")
    if "layernorm" in tags or ("var" in tags and "mean" in tags):
        cap("OC", "a LayerNorm")
    elif "mean" in tags:
        cap("OC", "a mean over it")
    if "rms" in tags or "sumsq" in tags:
        cap("O", "an RMS norm")
    if "shift" in tags:
        cap("OC", "a constant added to every entry")
    if "square" in tags and "sumsq" not in tags:
        cap("S", "squared elementwise")
    for t in sorted(tags):
        if t.startswith("nonlinear:"):
            cap("S", f"an elementwise {t.split(':', 1)[1]}")
        elif t.startswith("odd:"):
            cap("SP", f"an odd elementwise {t.split(':', 1)[1]}")
        elif t == "homogeneous":
            cap("S", "a ReLU-like unit")
        elif t == "product":
            cap("S", "an elementwise product of two features")
        elif t == "softmax":
            cap("S", "a softmax over it")
        elif t == "topk":
            cap("S", "a top-k over it")
        elif t.startswith("reduce:"):
            cap("S", f"a {t.split(':', 1)[1]} over it")
    # the reasons that decide the group (those that allow no more than it), each once
    why = list(dict.fromkeys(reason for to, reason in caps if to == g))
    return g, why
