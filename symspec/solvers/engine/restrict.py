"""Restricting the search to subgroups (``--groups perm``), and embedding the result back.

A restriction maps every space's group to a subgroup with the same representations:

- ``full``: the group itself;
- ``perm``: its permutation subgroup, the paper's ablation: O(n), OC(n), GL(n), SP(n)
  -> S(n) (on a residual stream: the paper's permutation baseline); D(n), Dpos(n) and the
  RoPE commutant, a global sign -> Id(n); a head group keeps its head permutation and drops its
  within-head maps (Heads(H, qk=GL(dh), ...) -> Heads(H, qk=Id(dh), ...));
- ``fixed``: Id(n), the space is not searched; a head group keeps its head structure,
  which its representations need (Heads(H, qk=Id(dh), ...)), so its head permutation
  is still searched.

Each group kind says what its subgroups are (:meth:`~symspec.groups.Group.permutation_subgroup`,
:meth:`~symspec.groups.Group.fixed_subgroup`) and how their elements embed in it
(:meth:`~symspec.groups.Group.embed`): the solution, found in the subgroup, is written in
the full group's terms by :func:`embed` (a permutation as an orthogonal matrix, the
identity of the within-head maps, ...), so a transform record always names the spec's
own groups.
"""

from __future__ import annotations

from collections.abc import Mapping

import attrs
import torch

from ...errors import SymspecInputError, suggest
from ...groups import Element, Group
from ...problem import Problem

MODES = ("full", "perm", "fixed")


def restrict_group(group: Group, mode: str) -> Group:
    """``group`` restricted by ``mode`` (one of :data:`MODES`)."""
    if mode == "full":
        return group
    if mode == "fixed":
        return group.fixed_subgroup()
    if mode == "perm":
        return group.permutation_subgroup()
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


def embed(full: Group, sub: Group, e: Element, dtype: torch.dtype = torch.float64) -> Element:
    """An element of ``sub`` (a subgroup of ``full``) in ``full``'s own fields; new
    floating-point fields get ``dtype``."""
    return full.embed(sub, e, dtype)
