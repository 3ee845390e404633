"""The typed problem description that transforms and solvers see.

It says which spaces there are (each with a concrete group), and for each parameter
which of its axes carry which spaces, in which representation and variance. It knows
nothing of YAML, of torch.fx, or of any particular architecture: a new spec gets every
solver for free.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import attrs
import torch

from .errors import Location
from .groups import Element, Group

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
class HeadMajor:
    """The storage order of a concatenated axis laid out per head, ``cat(q, k, v, heads=H)``:
    an explicit, invertible index map.

    Segments and groups see the *concatenated* order: the parts one after the other, part
    p holding its ``heads`` slices of width ``widths[p]`` one after the other (what
    ``cat(q, k, v)`` means). The tensor stores the heads first: block h, of width
    ``W = sum(widths)``, holds head h's slice of every part in order
    (``[h0: q k v][h1: q k v]...``, GPT-NeoX's query_key_value). ``forward`` maps a
    concatenated index to its storage index, ``reverse`` maps it back.

    >>> m = HeadMajor(2, (1, 1, 2))   # storage [h0: q k v v][h1: q k v v]
    >>> [m.forward(i) for i in range(m.size)]
    [0, 4, 1, 5, 2, 3, 6, 7]
    >>> all(m.reverse(m.forward(i)) == i for i in range(m.size))
    True
    """

    heads: int
    widths: tuple[int, ...]

    def __attrs_post_init__(self) -> None:
        if self.heads < 1 or not self.widths or min(self.widths) < 1:
            raise ValueError(f"a head-major layout needs heads >= 1 and positive widths, got {self.heads}, {self.widths}")

    @property
    def block(self) -> int:
        """The width of one head's block in storage."""
        return sum(self.widths)

    @property
    def size(self) -> int:
        return self.heads * self.block

    def forward(self, i: int) -> int:
        """The storage index of concatenated index ``i``."""
        if not 0 <= i < self.size:
            raise IndexError(f"index {i} outside an axis of size {self.size}")
        offset = 0
        for w in self.widths:
            if i < self.heads * w:
                h, r = divmod(i, w)
                return h * self.block + offset + r
            i -= self.heads * w
            offset += w
        raise AssertionError("unreachable")  # pragma: no cover

    def reverse(self, s: int) -> int:
        """The concatenated index stored at ``s``."""
        if not 0 <= s < self.size:
            raise IndexError(f"index {s} outside an axis of size {self.size}")
        h, t = divmod(s, self.block)
        start = 0
        for w in self.widths:
            if t < w:
                return start + h * w + t
            t -= w
            start += self.heads * w
        raise AssertionError("unreachable")  # pragma: no cover

    def index(self, device: torch.device | str | None = None) -> torch.Tensor:
        """``forward`` of every concatenated index, at once: ``x.index_select(0, index())``
        reads a stored axis in concatenated order."""
        parts, offset = [], 0
        for w in self.widths:
            heads = torch.arange(self.heads, device=device)[:, None] * self.block
            parts.append((heads + offset + torch.arange(w, device=device)[None, :]).reshape(-1))
            offset += w
        return torch.cat(parts)

    def to_concat(self, x: torch.Tensor) -> torch.Tensor:
        """Axis 0 of ``x`` from storage to concatenated order."""
        return x.index_select(0, self.index(x.device))

    def to_storage(self, x: torch.Tensor) -> torch.Tensor:
        """Axis 0 of ``x`` from concatenated to storage order (undoes :meth:`to_concat`)."""
        return x.index_select(0, torch.argsort(self.index(x.device)))

    def take(self, x: torch.Tensor, segment: Segment) -> torch.Tensor:
        """A segment (concatenated order) of axis 0 of a stored ``x``."""
        return x.index_select(0, self.index(x.device)[segment.start : segment.stop])


def take_segment(x: torch.Tensor, segment: Segment, layout: HeadMajor | None) -> torch.Tensor:
    """A segment of axis 0 of a stored tensor: a slice, or its positions under a layout."""
    return x[segment.start : segment.stop] if layout is None else layout.take(x, segment)


@attrs.frozen
class AxisBinding:
    axis: int
    segments: tuple[Segment, ...]
    #: how the concatenated segments are stored (None: one after the other)
    layout: HeadMajor | None = None

    def __str__(self) -> str:
        segs = [" @ ".join(str(f) for f in s.factors) for s in self.segments]
        if self.layout is not None:
            segs.append(f"heads={self.layout.heads}")
        return f"cat({', '.join(segs)})" if len(segs) > 1 else segs[0]


@attrs.frozen
class AxisView:
    """How a stored tensor is seen by its axis bindings: stored axes reordered and merged,
    ``view: [[0, 1], 2]`` (a mixture-of-experts weight [E, f, d] seen as [E*f, d]).
    ``merge[i]`` lists the stored axes of viewed axis i, outermost first (row-major: the
    viewed index is ``e * f + u``). Every stored axis appears once.

    >>> v = AxisView((4, 16, 24), ((1,), (0, 2)))   # down_proj [E, d, f] seen as [d, E*f]
    >>> v.shape
    (16, 96)
    >>> x = torch.randn(4, 16, 24)
    >>> bool((v.to_stored(v.to_view(x)) == x).all())
    True
    """

    stored: tuple[int, ...]
    merge: tuple[tuple[int, ...], ...]

    def __attrs_post_init__(self) -> None:
        flat = [a for m in self.merge for a in m]
        if sorted(flat) != list(range(len(self.stored))) or any(not m for m in self.merge):
            raise ValueError(f"a view must name every stored axis once (0..{len(self.stored) - 1}), got {[list(m) for m in self.merge]}")

    @property
    def order(self) -> tuple[int, ...]:
        return tuple(a for m in self.merge for a in m)

    @property
    def shape(self) -> tuple[int, ...]:
        out = []
        for m in self.merge:
            n = 1
            for a in m:
                n *= self.stored[a]
            out.append(n)
        return tuple(out)

    def to_view(self, x: torch.Tensor) -> torch.Tensor:
        """A stored tensor as its axis bindings see it (a copy when axes move)."""
        return x.permute(self.order).reshape(self.shape)

    def to_stored(self, y: torch.Tensor) -> torch.Tensor:
        """The inverse of :meth:`to_view`."""
        order = self.order
        y = y.reshape(tuple(self.stored[a] for a in order))
        inverse = [0] * len(order)
        for i, a in enumerate(order):
            inverse[a] = i
        return y.permute(inverse).contiguous()

    def __str__(self) -> str:
        return "[" + ", ".join(str(m[0]) if len(m) == 1 else "[" + ", ".join(map(str, m)) + "]" for m in self.merge) + "]"


@attrs.frozen
class ParamBinding:
    """A parameter's bound axes. ``shape`` is the shape the axes see: the stored shape,
    or with a ``view`` (:class:`AxisView`) the viewed one; :meth:`viewed` and
    :meth:`stored` move a tensor between the two. State dicts hold stored tensors; code
    that moves a tensor's bound axes reads it through :meth:`viewed`."""

    name: str
    shape: tuple[int, ...]
    axes: tuple[AxisBinding, ...]
    loc: Location = attrs.field(default=_NOLOC, eq=False, repr=False)
    view: AxisView | None = None

    def spaces(self) -> set[str]:
        return {f.space for a in self.axes for s in a.segments for f in s.factors}

    def viewed(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.view is None else self.view.to_view(x)

    def stored(self, y: torch.Tensor) -> torch.Tensor:
        return y if self.view is None else self.view.to_stored(y)


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
    #: the axis's storage layout (a segment is then not a slice)
    layout: HeadMajor | None = None

    @property
    def factor(self) -> Factor:
        return self.segment.factors[self.position]

    def take(self, moved: torch.Tensor) -> torch.Tensor:
        """The segment of a tensor whose axis ``self.axis`` was moved to the front."""
        return take_segment(moved, self.segment, self.layout)


@attrs.frozen
class Site:
    """An activation site: features (an axis of a traced node's output, the last unless
    ``dim`` says otherwise) on which
    the spaces act as on one axis of a bound weight, the representation included.

    ``name`` is stable across traces (``out:W``, the output of the layer with weight W;
    ``in:W``, what it reads; ``post:W:k``, the k-th elementwise function of W's output);
    ``node`` is the FX node it was found at; ``kind`` is ``pre`` (a layer's output) or
    ``post`` (after a nonlinearity: what the next layer reads). ``axis`` says how the
    spaces act on the features, with ``axis.axis == 0``: a feature transforms as the
    producing weight's output axis (queries co, keys contra through the dual), or as the
    dual of the reading weight's input axis (a layer that reads ``resid*`` reads features
    that move by ``resid``)."""

    name: str
    node: str
    kind: str
    param: str
    axis: AxisBinding
    module: str = ""
    #: the axis of the node's output that carries the features: the last (-1), or a
    #: convolution's channels (1: ``(batch, channels, *positions)``)
    dim: int = -1

    @property
    def size(self) -> int:
        """The number of features."""
        return sum(s.size for s in self.axis.segments)

    def spaces(self) -> set[str]:
        return {f.space for s in self.axis.segments for f in s.factors}

    def binding(self, tokens: int) -> ParamBinding:
        """The site as a bound (features x tokens) tensor: what the weights' solvers and
        transforms read."""
        return ParamBinding(f"site:{self.name}", (self.size, tokens), (self.axis,))


@attrs.frozen
class Problem:
    """Spaces, their groups, the parameter axes incident to each, and (when the model was
    traced) the activation sites where data shows each space."""

    spaces: dict[str, SpaceInstance]
    params: dict[str, ParamBinding]
    invariants: tuple[str, ...] = ()
    #: groups of parameter names that share one tensor (after canonicalisation)
    ties: tuple[tuple[str, ...], ...] = ()
    sites: tuple[Site, ...] = ()
    #: the model outputs the symmetries preserve (the spec's ``outputs``; empty: all):
    #: what every function check compares
    outputs: tuple[str, ...] = ()

    def sites_of(self, space: str) -> list[Site]:
        return [s for s in self.sites if space in s.spaces()]

    def incidences(self, space: str) -> Iterator[Incidence]:
        for p in self.params.values():
            for a in p.axes:
                for s in a.segments:
                    for i, f in enumerate(s.factors):
                        if f.space == space:
                            yield Incidence(p.name, a.axis, s, i, a.layout)

    def params_of(self, space: str) -> list[str]:
        return [p.name for p in self.params.values() if space in p.spaces()]

    def instances_of(self, decl: str) -> list[str]:
        return [s.name for s in self.spaces.values() if s.decl == decl]

    def declared_spaces(self) -> list[str]:
        return list(dict.fromkeys(s.decl for s in self.spaces.values()))

    def complete(self, elements: Mapping[str, Element]) -> dict[str, Element]:
        """``elements`` with the identity for every space they leave out (a method's result
        names only the spaces it searched)."""
        return {s: elements[s] if s in elements else si.group.identity() for s, si in self.spaces.items()}

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
