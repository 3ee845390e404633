"""The group protocol and the registry of group kinds (the text form is parsed in
:mod:`symspec.groups.text`).

A group is a small frozen (hashable) object: ``S(64)``, ``OC(768)``,
``Heads(12, qk=GL(64), ov=GL(64))``. Its text form round-trips: ``parse(str(g)) == g``.

An *element* of a group is a plain ``dict[str, Tensor]`` (a permutation's ``perm``, a
matrix group's ``matrix``, ...). Elements may carry leading batch dimensions, which is
how a head-structured group holds one within-head element per head. Plain tensors make
elements trivial to move between devices and to save in safetensors.

A group acts on vector spaces through representations named by a *path*: ``()`` is the
natural one; a head group has one per part (``("qk",)``) and, with grouped-query
attention, a key/value view (``("qk", "kv")``). Along an axis, a representation acts
with a *variance*:

- ``co``: rho(g), the way an output axis of a linear map transforms;
- ``contra``: rho(g)^-T, the way an input axis (or the dual side of a pairing) does;
- ``abs``: |rho(g)| entrywise, the way a norm gain transforms under a signed permutation.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from typing import Any, ClassVar, Literal

import attrs
import torch

from ..errors import GroupError
from ..linalg import lu_solve

Element = dict[str, torch.Tensor]
Variance = Literal["co", "contra", "abs"]
Path = tuple[str, ...]
VARIANCES: tuple[str, ...] = ("co", "contra", "abs")

#: group kind name -> class; every concrete group registers itself here.
REGISTRY: dict[str, type[Group]] = {}

#: common misspellings, used only to suggest the canonical name in error messages.
ALIASES: dict[str, str] = {
    "Orth": "O",
    "Orthogonal": "O",
    "orthogonal": "O",
    "Perm": "S",
    "perm": "S",
    "Permutation": "S",
    "permutation": "S",
    "Sym": "S",
    "GLn": "GL",
    "Invertible": "GL",
    "Diag": "D",
    "Rope": "RoPE",
    "rope": "RoPE",
    "SignedPerm": "SP",
    "Head": "Heads",
}


def register(cls: type[Group]) -> type[Group]:
    REGISTRY[cls.kind] = cls
    return cls


def make_generator(seed: int | torch.Generator | None) -> torch.Generator:
    if isinstance(seed, torch.Generator):
        return seed
    g = torch.Generator()
    g.manual_seed(0 if seed is None else int(seed))
    return g


class Group(ABC):
    """Base class of every group kind.

    Subclasses are ``attrs.frozen`` classes whose fields, in order, are the arguments of
    the text form: positional ``int`` fields first, then keyword options.
    """

    kind: ClassVar[str]
    #: fields printed as keywords (``kv=8``) rather than positionally
    keyword_fields: ClassVar[tuple[str, ...]] = ()

    # -- text form -------------------------------------------------------------------
    def __str__(self) -> str:
        parts: list[str] = []
        for f in attrs.fields(type(self)):
            value = getattr(self, f.name)
            default: Any = f.default if f.default is not attrs.NOTHING else object()
            if isinstance(default, attrs.Factory):  # type: ignore[arg-type]
                default = default.factory(self) if default.takes_self else default.factory()  # type: ignore[call-arg]
            if f.name in self.keyword_fields:
                if value == default:
                    continue
                parts.append(f"{f.name}={_fmt(value)}")
            else:
                parts.append(_fmt(value))
        return f"{self.kind}({', '.join(parts)})"

    # -- structure --------------------------------------------------------------------
    @property
    @abstractmethod
    def n(self) -> int:
        """Size of the natural representation."""

    def rep_paths(self) -> list[Path]:
        """Every valid representation path."""
        return [()]

    def rep_size(self, path: Path = ()) -> int:
        self._check_path(path)
        return self.n

    def is_orthogonal(self, path: Path = ()) -> bool:
        """True when co and contra coincide (rho(g)^-T == rho(g) for every g)."""
        return False

    def _check_path(self, path: Path) -> None:
        if tuple(path) not in self.rep_paths():
            valid = ", ".join(".".join(p) or "(natural)" for p in self.rep_paths())
            raise GroupError(f"{self} has no representation '{'.'.join(path)}'; valid: {valid}")

    # -- the group law ----------------------------------------------------------------
    @abstractmethod
    def identity(self, *, batch: tuple[int, ...] = (), dtype: torch.dtype = torch.float64,
                 device: torch.device | str | None = None) -> Element: ...

    @abstractmethod
    def compose(self, a: Element, b: Element) -> Element:
        """The element acting as ``a`` after ``b``: matrix(compose(a, b)) == matrix(a) @ matrix(b)."""

    @abstractmethod
    def inverse(self, a: Element) -> Element: ...

    @abstractmethod
    def sample(self, seed: int | torch.Generator | None = None, *, batch: tuple[int, ...] = (),
               dtype: torch.dtype = torch.float64, device: torch.device | str | None = None,
               cond: float = 10.0) -> Element:
        """A random element, seeded.

        Non-compact groups (GL, scalings, the RoPE commutant) sample elements whose action
        has condition number at most ``cond``: float32 checks lose about log10(cond) digits.
        """

    @abstractmethod
    def apply(self, a: Element, x: torch.Tensor, path: Path = (), variance: Variance = "co") -> torch.Tensor:
        """Act on ``x`` along the first non-batch dimension.

        ``x`` has shape ``[*batch, rep_size(path), *rest]`` where ``batch`` are the element's
        batch dimensions.
        """

    # -- derived ----------------------------------------------------------------------
    def matrix(self, a: Element, path: Path = (), variance: Variance = "co") -> torch.Tensor:
        """The action matrix rho(g) (or rho(g)^-T, |rho(g)|) of the representation ``path``."""
        self._check_path(path)
        batch = self.batch_shape(a)
        size = self.rep_size(path)
        ref = next(iter(a.values()))
        dtype = ref.dtype if ref.is_floating_point() else torch.float64
        eye = torch.eye(size, dtype=dtype, device=ref.device).expand(*batch, size, size)
        return self.apply(a, eye, path, variance)

    def batch_shape(self, a: Element) -> tuple[int, ...]:
        """Leading batch dimensions of an element."""
        ref = self.identity(batch=())
        key = next(iter(ref))
        nd = ref[key].ndim
        shape = tuple(a[key].shape)
        return shape[: len(shape) - nd]

    def contains(self, a: Element | torch.Tensor, atol: float = 1e-8) -> bool:
        """Membership: an element (checked for structure) or a natural-representation matrix."""
        if isinstance(a, torch.Tensor):
            return self.contains_matrix(a, atol)
        try:
            if not self.element_ok(a, atol):
                return False
            return self.contains_matrix(self.matrix(a), atol)
        except (KeyError, RuntimeError, IndexError, ValueError):
            return False

    def element_ok(self, a: Element, atol: float) -> bool:
        """Structural check of an element's fields (shapes); value checks are in contains_matrix."""
        ref = self.identity(batch=())
        if set(a) != set(ref):
            return False
        batch = self.batch_shape(a)
        return all(tuple(a[k].shape) == (*batch, *ref[k].shape) for k in ref)

    @abstractmethod
    def contains_matrix(self, m: torch.Tensor, atol: float = 1e-8) -> bool:
        """Membership of a natural-representation matrix."""

    def to(self, a: Element, dtype: torch.dtype | None = None, device: torch.device | str | None = None) -> Element:
        """Move an element; integer fields (permutations) keep their dtype."""
        out = {}
        for k, v in a.items():
            if v.is_floating_point() and dtype is not None:
                out[k] = v.to(device=device, dtype=dtype)
            else:
                out[k] = v.to(device=device)
        return out

    def equal(self, a: Element, b: Element, atol: float = 1e-9) -> bool:
        """Same element (same action), up to ``atol`` on the action matrices."""
        ma = self.matrices(a)
        mb = self.matrices(b)
        return all(torch.allclose(x, y.to(x.dtype), atol=atol, rtol=0) for x, y in zip(ma, mb))

    def matrices(self, a: Element) -> list[torch.Tensor]:
        return [self.matrix(a, p) for p in self.rep_paths()]

    def testing_elements(self) -> list[Element]:
        """A few deterministic elements, the identity first, for :func:`symspec.testing.check_group`
        and the tests (escnn's groups have the same). The default: the identity and three
        seeded samples; a kind whose samples rarely give some element worth testing may
        override it to add that element."""
        return [self.identity(), *(self.sample(seed) for seed in (1, 2, 3))]

    # -- what matching needs to know of a kind -------------------------------------------
    def is_trivial(self) -> bool:
        """True for the trivial group (the identity only): matching does not search its
        spaces. A kind that is trivial only at some sizes (S(1)) may say False: searching
        it costs nothing."""
        return False

    def permutation_subgroup(self) -> Group:
        """The subgroup ``--groups perm`` searches, with the same representations: the
        permutations in the group (the paper's ablation), Id(n) where it has none."""
        raise GroupError(f"no permutation subgroup known for {self}")

    def fixed_subgroup(self) -> Group:
        """The subgroup ``--groups fixed`` searches: Id(n), nothing."""
        from .classic import Id  # the trivial group is one of the kinds defined on this base

        return Id(self.n)

    def embed(self, sub: Group, a: Element, dtype: torch.dtype = torch.float64) -> Element:
        """An element ``a`` of ``sub`` (a subgroup of this group, as :meth:`permutation_subgroup`
        and :meth:`fixed_subgroup` give) in this group's own fields, so that a result found
        in the subgroup names the spec's group; new floating-point fields get ``dtype``.
        Kinds with proper subgroups other than the trivial one extend it."""
        if sub == self:
            return a
        if sub.is_trivial():
            device = next(iter(a.values())).device
            return self.identity(batch=sub.batch_shape(a), dtype=dtype, device=device)
        raise GroupError(f"cannot write an element of {sub} as one of {self}")

    def best_fit(self, cross: torch.Tensor, gram: Callable[[], torch.Tensor]) -> torch.Tensor:
        """How well vectors b fit vectors a under this group's best element, from their
        statistics ``C = sum a b^T`` [..., n, n] and ``G = sum b b^T`` (``gram``, called only
        where the value needs it); larger is better, per batch entry (in C's dtype). The head
        assignment compares pairs of heads with it (:mod:`symspec.solvers.kinds.heads`), so a part
        that is the same for every pairing may be left out.

        Orthogonal groups: ``||C||_*``, the value of the best orthogonal map (max tr(Q^T C);
        ||Q b|| does not depend on Q): exact for O, an upper bound for its subgroups. Other
        groups: the least-squares fit ``tr(C G^-1 C^T)`` (max over X of 2<X, C> - <X G, X>),
        exact for GL, an upper bound for its subgroups."""
        c = cross.to(torch.float64)
        if self.is_orthogonal():
            return torch.linalg.matrix_norm(c, ord="nuc").to(cross.dtype)
        g = gram().to(torch.float64)
        lam = torch.diagonal(g, dim1=-2, dim2=-1).mean(-1).clamp_min(1e-300) * 1e-12
        eye = torch.eye(g.shape[-1], dtype=g.dtype, device=g.device)
        sol = lu_solve(g + lam[..., None, None] * eye, c.mT)
        return (c * sol.mT).sum((-1, -2)).to(cross.dtype)


def _fmt(value: Any) -> str:
    if isinstance(value, Group):
        return str(value)
    if isinstance(value, tuple):
        return "(" + ", ".join(_fmt(v) for v in value) + ")"
    return str(value)


def positive(instance: Any, attribute: attrs.Attribute, value: int) -> None:
    if not isinstance(value, int) or value < 1:
        raise ValueError(f"{attribute.name} must be a positive integer, got {value!r}")


def int_field(**kw: Any) -> Any:
    return attrs.field(validator=positive, metadata={"kind": "int"}, **kw)


def registry_summary() -> Mapping[str, str]:
    """Kind name -> first line of its docstring (for ``symspec specs`` and the docs)."""
    return {k: (c.__doc__ or "").strip().splitlines()[0] for k, c in sorted(REGISTRY.items())}


def log_uniform(gen: torch.Generator, shape: tuple[int, ...], cond: float, dtype: torch.dtype) -> torch.Tensor:
    """Values in [cond^-1/2, cond^1/2], log-uniform: condition number at most ``cond``."""
    half = 0.5 * math.log(cond)
    u = torch.rand(shape, generator=gen, dtype=torch.float64) * 2 * half - half
    return u.exp().to(dtype)
