"""The typed problem description that transforms and solvers see.

It says which spaces there are (each with a concrete group), and for each parameter
which of its axes carry which spaces, in which representation and variance. It knows
nothing of YAML, of torch.fx, or of any particular architecture: a new spec gets every
solver for free.
"""

from __future__ import annotations

from collections.abc import Iterator

import attrs

from .errors import Location
from .groups import Group

_NOLOC = Location()


@attrs.frozen
class Factor:
    """One space acting on a segment of an axis: ``rho_path(g)`` with a variance."""

    space: str
    path: tuple[str, ...] = ()
    variance: str = "co"

    def __str__(self) -> str:
        ref = self.space + ("." + ".".join(self.path) if self.path else "")
        return {"co": ref, "contra": ref + "*", "abs": f"abs({ref})"}[self.variance]


@attrs.frozen
class Segment:
    """A contiguous slice ``[start, start + size)`` of an axis and the factors acting on it.

    ``factors[-1]`` acts first (matrix order: the segment transforms by
    ``rho_0 @ rho_1 @ ... @ rho_k``).
    """

    start: int
    size: int
    factors: tuple[Factor, ...]

    @property
    def stop(self) -> int:
        return self.start + self.size


@attrs.frozen
class AxisBinding:
    axis: int
    segments: tuple[Segment, ...]

    def __str__(self) -> str:
        segs = [" @ ".join(str(f) for f in s.factors) for s in self.segments]
        return f"cat({', '.join(segs)})" if len(segs) > 1 else segs[0]


@attrs.frozen
class ParamBinding:
    name: str
    shape: tuple[int, ...]
    axes: tuple[AxisBinding, ...]
    loc: Location = attrs.field(default=_NOLOC, eq=False, repr=False)

    def spaces(self) -> set[str]:
        return {f.space for a in self.axes for s in a.segments for f in s.factors}


@attrs.frozen
class SpaceInstance:
    """A concrete space: ``ff[3]`` of the declared space ``ff``, with its group."""

    name: str
    decl: str
    index: int | None
    group: Group
    loc: Location = attrs.field(default=_NOLOC, eq=False, repr=False)


@attrs.frozen
class Incidence:
    """One place a space acts: a parameter, an axis, a segment and the factor's position."""

    param: str
    axis: int
    segment: Segment
    position: int

    @property
    def factor(self) -> Factor:
        return self.segment.factors[self.position]


@attrs.frozen
class Problem:
    """Spaces, their groups, and the parameter axes incident to each."""

    spaces: dict[str, SpaceInstance]
    params: dict[str, ParamBinding]
    invariants: tuple[str, ...] = ()
    #: groups of parameter names that share one tensor (after canonicalisation)
    ties: tuple[tuple[str, ...], ...] = ()

    def incidences(self, space: str) -> Iterator[Incidence]:
        for p in self.params.values():
            for a in p.axes:
                for s in a.segments:
                    for i, f in enumerate(s.factors):
                        if f.space == space:
                            yield Incidence(p.name, a.axis, s, i)

    def params_of(self, space: str) -> list[str]:
        return [p.name for p in self.params.values() if space in p.spaces()]

    def instances_of(self, decl: str) -> list[str]:
        return [s.name for s in self.spaces.values() if s.decl == decl]

    def declared_spaces(self) -> list[str]:
        return list(dict.fromkeys(s.decl for s in self.spaces.values()))

    def differences(self, other: Problem, here: str, there: str) -> list[str]:
        """How this problem differs from ``other`` (spaces and their groups, bound
        parameters and their shapes), one line each, e.g. ``space ff[0] is S(12) in A but
        S(16) in B`` with ``here="in A"``, ``there="in B"``."""
        out = []
        for s in sorted(set(self.spaces) | set(other.spaces)):
            mine = self.spaces[s].group if s in self.spaces else None
            theirs = other.spaces[s].group if s in other.spaces else None
            if mine != theirs:
                out.append(f"space {s} is {mine or 'absent'} {here} but {theirs or 'absent'} {there}")
        for p in sorted(set(self.params) | set(other.params)):
            a = self.params[p].shape if p in self.params else None
            b = other.params[p].shape if p in other.params else None
            if a != b:
                out.append(f"{p} has shape {list(a) if a else 'absent'} {here} but {list(b) if b else 'absent'} {there}")
        return out
