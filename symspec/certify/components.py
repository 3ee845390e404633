"""Which spaces a joint bound relaxes together (see :mod:`.joint`): two spaces interact
when one parameter carries them on two of its axes (:func:`components`); a group of
interacting spaces that is a star (:func:`star_hub`) fits the Gram relaxation, of size
:func:`gram_size`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import networkx as nx

from ..problem import Problem


def interactions(problem: Problem, chosen: list[str]) -> tuple[set[frozenset[str]], set[str]]:
    """(the pairs of ``chosen`` spaces that one parameter carries on two of its axes, the
    spaces a parameter carries on two axes: quadratic in their variable)."""
    edges: set[frozenset[str]] = set()
    quadratic: set[str] = set()
    wanted = set(chosen)
    for pb in problem.params.values():
        on_axes = [got for ab in pb.axes
                   if (got := {f.space for seg in ab.segments for f in seg.factors if f.space in wanted})]
        if len(on_axes) < 2:
            continue
        seen: set[str] = set()
        for got in on_axes:
            quadratic |= got & seen
            edges |= {frozenset((s, t)) for s in got for t in seen if s != t}
            seen |= got
    return edges, quadratic


def components(problem: Problem, chosen: list[str]) -> list[tuple[tuple[str, ...], bool]]:
    """``chosen`` split into the groups of spaces that interact: two spaces interact when
    one parameter carries them on two of its axes (their blocks are bilinear in the two
    variables); a space on two axes of one parameter interacts with itself (quadratic).
    Per group: (its spaces, whether it interacts at all). The objective's inner part is
    a sum over the groups, each over its own variables, so its maximum is the sum of the
    groups' maxima; a group that does not interact is linear in its variable and is
    maximised exactly (:func:`.model.linear_max`)."""
    edges, quadratic = interactions(problem, chosen)
    graph = nx.Graph()
    graph.add_nodes_from(chosen)
    graph.add_edges_from(tuple(e) for e in edges)
    groups = sorted(([s for s in chosen if s in comp] for comp in nx.connected_components(graph)),
                    key=lambda m: chosen.index(m[0]))
    return [(tuple(m), len(m) > 1 or m[0] in quadratic) for m in groups]


def star_hub(problem: Problem, members: tuple[str, ...], kinds: Mapping[str, str], ns: Mapping[str, int]) -> str | None:
    """The hub of a star-shaped group of interacting spaces: the one space every
    interaction involves (the others, permutations, interact with it alone, none with
    itself), an orthogonal map or a permutation (relaxed to the orthogonal group plus its
    permutation constraints); None if the group is not a star."""
    edges, quadratic = interactions(problem, list(members))
    if len(members) < 2 or quadratic & set(members):
        return None
    hubs = [s for s in members if all(s in e for e in edges)]
    if len(members) == 2:  # either end: the orthogonal one, else the wider
        hubs.sort(key=lambda s: (kinds[s] != "orth", -ns[s]))
    for h in hubs:
        if all(kinds[s] == "perm" for s in members if s != h):
            return h
    return None


def gram_size(problem: Problem, members: tuple[str, ...], hub: str, m: int) -> int:
    """The Gram relaxation's matrix size for a star: 2 m (the hub's variable m x m) plus
    one row per vector the leaves move against the hub (a parameter with the hub on one
    axis and a leaf on another contributes its size over the hub axis' size)."""
    rows = 0
    leaves = set(members) - {hub}
    for pb in problem.params.values():
        hub_axes = [ab for ab in pb.axes if any(f.space == hub for seg in ab.segments for f in seg.factors)]
        if hub_axes and any(f.space in leaves for ab in pb.axes for seg in ab.segments for f in seg.factors):
            rows += math.prod(pb.shape) // max(1, pb.shape[hub_axes[0].axis])
    return 2 * m + rows

