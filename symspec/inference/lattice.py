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

import attrs


@attrs.frozen
class Candidate:
    """What inference does with one group kind (see :data:`CANDIDATES`)."""

    #: inference drafts this kind for a space (False: it never proposes it, and says so here)
    proposed: bool
    #: the kinds inference proposes that this one contains, itself included (the lattice
    #: order among plain kinds; empty for a structured or never-proposed kind)
    below: frozenset[str] = frozenset()
    #: what the shrinking tries after this kind fails its check, in order (a structured
    #: kind shrinks by its parts: a head group's QK then OV map, an expert group's units)
    shrink: tuple[str, ...] = ()
    #: the next larger kind (what a test shows fails where this one is inferred), or None
    larger: str | None = None


#: the candidate lattice, keyed by the group kind's registry name (symspec.groups.REGISTRY):
#: plain classes take one of GL ⊃ O ⊃ {OC, SP} ⊃ S ⊃ Id (OC ∧ SP = S)
CANDIDATES: dict[str, Candidate] = {
    "GL": Candidate(True, frozenset({"GL", "O", "OC", "SP", "S", "Id"}), ("O", "S", "Id")),
    "O": Candidate(True, frozenset({"O", "OC", "SP", "S", "Id"}), ("SP", "S", "Id"), larger="GL"),
    "OC": Candidate(True, frozenset({"OC", "S", "Id"}), ("S", "Id"), larger="O"),
    "SP": Candidate(True, frozenset({"SP", "S", "Id"}), ("S", "Id"), larger="O"),
    "S": Candidate(True, frozenset({"S", "Id"}), ("Id",), larger="SP"),
    "Id": Candidate(True, frozenset({"Id"})),
    # scalings a gated unit (D) or a ReLU-like unit (Dpos) admits
    "D": Candidate(True, shrink=("Dpos", "Id"), larger="GL"),
    "Dpos": Candidate(True, shrink=("Id",), larger="D"),
    # a head's QK map under rotary embeddings
    "RoPE": Candidate(True, shrink=("Id",), larger="GL"),
    # the global sign of the residual stream, where an odd function passes it
    "Sign": Candidate(True, shrink=("Id",)),
    "Heads": Candidate(True),
    "Experts": Candidate(True),
}
#: the kinds a head group's QK or OV map takes in a draft
HEAD_PARTS = frozenset({"GL", "O", "RoPE", "Id"})
#: plain kinds from largest to smallest (where two are incomparable, the first found wins a meet)
ORDER = ("GL", "O", "OC", "SP", "S", "Id")


def shrink_chain(kind: str, within: frozenset[str] | None = None) -> list[str]:
    """What the shrinking tries after ``kind`` fails, kept to ``within`` where given."""
    return [g for g in CANDIDATES[kind].shrink if within is None or g in within]


def meet(a: str, b: str) -> str:
    """The largest plain kind below both."""
    common = CANDIDATES[a].below & CANDIDATES[b].below
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
