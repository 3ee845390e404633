"""Restricting the search to subgroups (``--groups perm``), and embedding the result back.

A restriction maps every space's group to a subgroup with the same representations:

- ``full``: the group itself;
- ``perm``: its permutation subgroup, the paper's ablation: O(n), OC(n), GL(n), SP(n)
  -> S(n) (on a residual stream: the paper's permutation baseline); D(n), Dpos(n) and the
  RoPE commutant, a global sign -> Id(n); a head group keeps its head permutation and drops its
  within-head maps (Heads(H, qk=GL(dh), ...) -> Heads(H, qk=Id(dh), ...));
- ``fixed``: Id(n), the space is not searched.

Per kind rules live in :data:`PERMUTATION_SUBGROUP`. The solution, found in the
subgroup, is written in the full group's terms by :func:`embed` (a permutation as an
orthogonal matrix, the identity of the within-head maps, ...), so a transform record
always names the spec's own groups.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import attrs
import torch

from ..errors import SymspecInputError, suggest
from ..groups import GL, OC, SP, Element, Group, Heads, Id, O, S
from ..problem import Problem

MODES = ("full", "perm", "fixed")

#: group kind -> its permutation subgroup (same representation sizes)
PERMUTATION_SUBGROUP: dict[str, Callable[[Group], Group]] = {
    "S": lambda g: g,
    "SP": lambda g: S(g.n),
    "O": lambda g: S(g.n),
    "OC": lambda g: S(g.n),
    "GL": lambda g: S(g.n),
    "D": lambda g: Id(g.n),
    "Dpos": lambda g: Id(g.n),
    "RoPE": lambda g: Id(g.n),
    "Sign": lambda g: Id(g.n),
    "Id": lambda g: g,
    # head permutations only: the within-head maps are not searched (the paper's baseline)
    "Heads": lambda g: Heads(g.heads, tuple((name, Id(w.n)) for name, w in g.parts), g.kv),  # type: ignore[attr-defined]
}


def restrict_group(group: Group, mode: str) -> Group:
    if mode == "full":
        return group
    if mode == "fixed":
        return Id(group.n) if not isinstance(group, Heads) else Heads(group.heads, tuple((n, Id(w.n)) for n, w in group.parts), group.kv)
    if mode == "perm":
        rule = PERMUTATION_SUBGROUP.get(group.kind)
        if rule is None:
            raise SymspecInputError(f"no permutation subgroup known for {group}")
        return rule(group)
    raise SymspecInputError(f"unknown group restriction '{mode}'; use one of {', '.join(MODES)}")


def parse_restriction(text: str | Mapping[str, str] | None, problem: Problem) -> dict[str, str]:
    """``"perm"``, ``"full"``, or ``"perm,attn=full"`` (declared space = mode, with an
    optional default) -> a mode per space instance.

    >>> from symspec.problem import Problem
    >>> parse_restriction("perm", Problem({}, {}))
    {}
    """
    default = "full"
    per_decl: dict[str, str] = {}
    if isinstance(text, Mapping):
        items = [f"{k}={v}" for k, v in text.items()]
    else:
        items = [x.strip() for x in (text or "full").split(",") if x.strip()]
    declared = problem.declared_spaces()
    for item in items:
        key, sep, mode = item.partition("=")
        key, mode = key.strip(), mode.strip()
        if not sep:
            key, mode = "", key
        if mode not in MODES:
            hint = suggest(mode, MODES)
            raise SymspecInputError(f"--groups: unknown restriction '{mode}'" + (f"; {hint}" if hint else f"; use {', '.join(MODES)}"))
        if not key:
            default = mode
            continue
        if key not in declared:
            hint = suggest(key, declared)
            raise SymspecInputError(f"--groups: no space '{key}' in the spec" + (f"; {hint}" if hint else f"; spaces: {', '.join(declared)}"))
        per_decl[key] = mode
    return {name: per_decl.get(si.decl, default) for name, si in problem.spaces.items()}


def restrict_problem(problem: Problem, modes: Mapping[str, str]) -> Problem:
    """The same problem with every space's group replaced by its restriction."""
    spaces = {name: attrs.evolve(si, group=restrict_group(si.group, modes.get(name, "full")))
              for name, si in problem.spaces.items()}
    return attrs.evolve(problem, spaces=spaces)


def _batch(group: Group, e: Element) -> tuple[int, ...]:
    return group.batch_shape(e) if not isinstance(group, Heads) else ()


def embed(full: Group, sub: Group, e: Element, dtype: torch.dtype = torch.float64) -> Element:
    """An element of ``sub`` (a subgroup of ``full``) in ``full``'s own fields; new
    floating-point fields get ``dtype``."""
    if sub == full:
        return e
    device = next(iter(e.values())).device
    if isinstance(full, Heads) and isinstance(sub, Heads):
        parts = {name: embed(full.part(name), sub.part(name), sub.within(e, name), dtype) for name, _ in full.parts}
        return full._assemble(e["perm"], e["qperm"], parts)
    batch = _batch(sub, e)
    if isinstance(sub, Id):
        return full.identity(batch=batch, dtype=dtype, device=device)
    if isinstance(sub, S) and isinstance(full, SP):
        return {"perm": e["perm"], "sign": torch.ones(e["perm"].shape, dtype=dtype, device=device)}
    if isinstance(sub, S) and isinstance(full, (O, OC, GL)):
        return {"matrix": sub.matrix(e).to(dtype)}
    raise SymspecInputError(f"cannot write an element of {sub} as one of {full}")
