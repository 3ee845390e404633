"""The elementary continuous groups: orthogonal, centred orthogonal, invertible, diagonal
scalings and the RoPE commutant (the ones that move entries are in :mod:`symspec.groups.classic`).

Every element may carry leading batch dimensions (one element per head, say); the
operations broadcast over them.
"""

from __future__ import annotations

import functools
import math
from typing import ClassVar

import attrs
import torch

from ..linalg import lu_inv
from .base import Element, Group, Path, Variance, int_field, log_uniform, make_generator, register
from .classic import Id, S, _flatten_rest, _restore, _transposed


def _left_mul(m: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """m @ x; on a transposed view, computed as (x.T @ m.T).T, which reads x in its own
    memory order and returns the transposed view of a contiguous result (several times
    faster for the [vocab, d] embeddings than multiplying the strided view)."""
    if m.ndim == 2 and _transposed(x):
        return (x.mT @ m.mT).mT
    return m @ x


def _eye(n: int, batch: tuple[int, ...], dtype: torch.dtype, device: torch.device | str | None) -> torch.Tensor:
    return torch.eye(n, dtype=dtype, device=device).expand(*batch, n, n).clone()


def _haar(gen: torch.Generator, batch: tuple[int, ...], n: int) -> torch.Tensor:
    z = torch.randn(*batch, n, n, generator=gen, dtype=torch.float64)
    q, r = torch.linalg.qr(z)
    return q * torch.sign(torch.diagonal(r, dim1=-2, dim2=-1)).unsqueeze(-2)


def _orthogonal_ok(m: torch.Tensor, atol: float) -> bool:
    if m.ndim < 2 or m.shape[-1] != m.shape[-2] or not torch.isfinite(m).all():
        return False
    n = m.shape[-1]
    eye = torch.eye(n, dtype=m.dtype, device=m.device)
    return bool(((m.mT @ m - eye).abs() <= atol * max(1, n) ** 0.5).all())


class _MatrixGroup(Group):
    """Groups whose elements are stored as their action matrix."""

    size: int

    @property
    def n(self) -> int:
        return self.size

    def identity(self, *, batch=(), dtype=torch.float64, device=None) -> Element:
        return {"matrix": _eye(self.size, batch, dtype, device)}

    def compose(self, a: Element, b: Element) -> Element:
        return {"matrix": a["matrix"] @ b["matrix"]}

    def inverse(self, a: Element) -> Element:
        m = a["matrix"]
        return {"matrix": m.mT.clone() if self.is_orthogonal() else lu_inv(m)}

    def apply(self, a: Element, x: torch.Tensor, path: Path = (), variance: Variance = "co") -> torch.Tensor:
        self._check_path(path)
        m = a["matrix"].to(device=x.device, dtype=x.dtype)
        nb = m.ndim - 2
        flat, rest = _flatten_rest(x, nb)
        if variance == "abs":
            m = m.abs()
        elif variance == "contra" and not self.is_orthogonal():
            # inv(m)^T @ x rather than solve(m^T, x): batched CPU solves with many
            # right-hand sides are ~30x slower, and the elements are well conditioned
            m = lu_inv(m).mT
        return _restore(_left_mul(m, flat), rest)

    def matrix(self, a: Element, path: Path = (), variance: Variance = "co") -> torch.Tensor:
        self._check_path(path)
        m = a["matrix"]
        if variance == "abs":
            return m.abs()
        if variance == "contra" and not self.is_orthogonal():
            return lu_inv(m).mT
        return m

    def permutation_subgroup(self) -> Group:
        return S(self.size)

    def embed(self, sub: Group, a: Element, dtype: torch.dtype = torch.float64) -> Element:
        if isinstance(sub, S):  # as its permutation matrix
            return {"matrix": sub.matrix(a).to(dtype)}
        return super().embed(sub, a, dtype)


@register
@attrs.frozen
class O(_MatrixGroup):  # noqa: E742 - the group is called O
    """Orthogonal O(n): the residual stream of an RMSNorm model once the gain is folded."""

    kind: ClassVar[str] = "O"
    size: int = int_field()

    def is_orthogonal(self, path: Path = ()) -> bool:
        return True

    def sample(self, seed=None, *, batch=(), dtype=torch.float64, device=None, cond=10.0) -> Element:
        return {"matrix": _haar(make_generator(seed), batch, self.size).to(dtype=dtype, device=device)}

    def contains_matrix(self, m: torch.Tensor, atol: float = 1e-8) -> bool:
        return m.shape[-1] == self.size and _orthogonal_ok(m, atol)


@functools.lru_cache(maxsize=64)
def centred_basis(n: int) -> torch.Tensor:
    """An orthonormal basis [n, n-1] of the zero-mean subspace (the complement of all-ones)."""
    m = torch.eye(n, dtype=torch.float64)
    m[:, 0] = 1.0
    q, _ = torch.linalg.qr(m)
    return q[:, 1:].contiguous()


@register
@attrs.frozen
class OC(_MatrixGroup):
    """Orthogonal maps fixing the all-ones vector, OC(n) ~ O(n-1): the residual of a
    LayerNorm model whose writers are mean-centred (they commute with LayerNorm)."""

    kind: ClassVar[str] = "OC"
    size: int = int_field()

    def is_orthogonal(self, path: Path = ()) -> bool:
        return True

    def sample(self, seed=None, *, batch=(), dtype=torch.float64, device=None, cond=10.0) -> Element:
        n = self.size
        if n == 1:
            return self.identity(batch=batch, dtype=dtype, device=device)
        r = _haar(make_generator(seed), batch, n - 1)
        b = centred_basis(n)
        q = b @ r @ b.T + torch.full((n, n), 1.0 / n, dtype=torch.float64)
        return {"matrix": q.to(dtype=dtype, device=device)}

    def contains_matrix(self, m: torch.Tensor, atol: float = 1e-8) -> bool:
        if m.shape[-1] != self.size or not _orthogonal_ok(m, atol):
            return False
        ones = torch.ones(self.size, 1, dtype=m.dtype, device=m.device)
        return bool(((m @ ones - ones).abs() <= atol * max(1, self.size) ** 0.5).all())

    @staticmethod
    def from_reduced(r: torch.Tensor) -> torch.Tensor:
        """Lift an (n-1)x(n-1) orthogonal matrix (in the centred basis) to OC(n)."""
        n = r.shape[-1] + 1
        b = centred_basis(n).to(dtype=r.dtype, device=r.device)
        return b @ r @ b.T + torch.full((n, n), 1.0 / n, dtype=r.dtype, device=r.device)


@register
@attrs.frozen
class GL(_MatrixGroup):
    """Invertible GL(n): per-head QK maps (q side g, k side g^-T) and OV maps."""

    kind: ClassVar[str] = "GL"
    size: int = int_field()

    def sample(self, seed=None, *, batch=(), dtype=torch.float64, device=None, cond=10.0) -> Element:
        gen = make_generator(seed)
        u = _haar(gen, batch, self.size)
        v = _haar(gen, batch, self.size)
        s = log_uniform(gen, (*batch, self.size), cond, torch.float64)
        return {"matrix": (u * s.unsqueeze(-2) @ v.mT).to(dtype=dtype, device=device)}

    def contains_matrix(self, m: torch.Tensor, atol: float = 1e-8) -> bool:
        if m.ndim < 2 or m.shape[-1] != self.size or m.shape[-2] != self.size or not torch.isfinite(m).all():
            return False
        s = torch.linalg.svdvals(m.to(torch.float64))
        return bool((s[..., -1] > s[..., 0] * max(atol, 1e-12)).all())


class DiagonalGroup(Group):
    """Diagonal scalings, D(n) and Dpos(n): one scale per unit."""

    size: int
    #: scales are positive (Dpos) rather than any nonzero value (D)
    positive_only: ClassVar[bool]

    @property
    def n(self) -> int:
        return self.size

    def identity(self, *, batch=(), dtype=torch.float64, device=None) -> Element:
        return {"diag": torch.ones(*batch, self.size, dtype=dtype, device=device)}

    def compose(self, a: Element, b: Element) -> Element:
        return {"diag": a["diag"] * b["diag"]}

    def inverse(self, a: Element) -> Element:
        return {"diag": 1.0 / a["diag"]}

    def sample(self, seed=None, *, batch=(), dtype=torch.float64, device=None, cond=10.0) -> Element:
        gen = make_generator(seed)
        d = log_uniform(gen, (*batch, self.size), cond, torch.float64)
        if not self.positive_only:
            d = d * torch.where(torch.rand(*batch, self.size, generator=gen) < 0.5, -1.0, 1.0).to(torch.float64)
        return {"diag": d.to(dtype=dtype, device=device)}

    def apply(self, a: Element, x: torch.Tensor, path: Path = (), variance: Variance = "co") -> torch.Tensor:
        self._check_path(path)
        d = a["diag"].to(device=x.device, dtype=x.dtype)
        if variance == "contra":
            d = 1.0 / d
        elif variance == "abs":
            d = d.abs()
        nb = d.ndim - 1
        flat, rest = _flatten_rest(x, nb)
        return _restore(flat * d.unsqueeze(-1), rest)

    def contains_matrix(self, m: torch.Tensor, atol: float = 1e-8) -> bool:
        if m.ndim < 2 or m.shape[-1] != self.size or m.shape[-2] != self.size:
            return False
        d = torch.diagonal(m, dim1=-2, dim2=-1)
        off = m - torch.diag_embed(d)
        if (off.abs() > atol).any() or not torch.isfinite(d).all():
            return False
        if self.positive_only:
            return bool((d > atol).all())
        return bool((d.abs() > atol).all())

    def permutation_subgroup(self) -> Group:
        return Id(self.size)


@register
@attrs.frozen
class D(DiagonalGroup):
    """Nonzero diagonal scalings D(n): the linear 'up' path of a gated MLP (SwiGLU, GeGLU)."""

    kind: ClassVar[str] = "D"
    positive_only: ClassVar[bool] = False
    size: int = int_field()


@register
@attrs.frozen
class Dpos(DiagonalGroup):
    """Positive diagonal scalings D+(n): units of a positively homogeneous activation (ReLU)."""

    kind: ClassVar[str] = "Dpos"
    positive_only: ClassVar[bool] = True
    size: int = int_field()


def _rot_default(self: RoPE) -> int:
    return self.size


@register
@attrs.frozen
class RoPE(Group):
    """The RoPE commutant RoPE(n): maps of a rotary QK head space that commute with every
    position's rotation, one 2x2 block aI + bJ per frequency pair (a nonzero complex
    scalar); with partial rotary (``rot < n``) the unrotated dims get GL(n - rot).

    ``layout=half`` pairs dim i with i + rot/2 (Llama, GPT-NeoX: rotate_half);
    ``layout=interleaved`` pairs 2i with 2i+1 (GPT-J, the original RoFormer).
    """

    kind: ClassVar[str] = "RoPE"
    keyword_fields: ClassVar[tuple[str, ...]] = ("rot", "layout")
    size: int = int_field()
    rot: int = attrs.field(default=attrs.Factory(_rot_default, takes_self=True), metadata={"kind": "int"})
    layout: str = attrs.field(default="half", metadata={"kind": "enum", "choices": ("half", "interleaved")})

    def __attrs_post_init__(self) -> None:
        if not isinstance(self.rot, int) or self.rot < 0 or self.rot > self.size or self.rot % 2:
            raise ValueError(f"rot must be an even integer between 0 and {self.size}, got {self.rot!r}")
        if self.layout not in ("half", "interleaved"):
            raise ValueError(f"layout must be half or interleaved, got {self.layout!r}")

    @property
    def n(self) -> int:
        return self.size

    @property
    def pairs(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Index arrays (first, second) of the rotated pairs."""
        k = self.rot // 2
        if self.layout == "half":
            return torch.arange(k), torch.arange(k) + k
        return torch.arange(k) * 2, torch.arange(k) * 2 + 1

    def _has_rest(self) -> bool:
        return self.rot < self.size

    def permutation_subgroup(self) -> Group:
        return Id(self.size)

    def identity(self, *, batch=(), dtype=torch.float64, device=None) -> Element:
        k = self.rot // 2
        out = {
            "a": torch.ones(*batch, k, dtype=dtype, device=device),
            "b": torch.zeros(*batch, k, dtype=dtype, device=device),
        }
        if self._has_rest():
            out["rest"] = _eye(self.size - self.rot, batch, dtype, device)
        return out

    def compose(self, a: Element, b: Element) -> Element:
        out = {
            "a": a["a"] * b["a"] - a["b"] * b["b"],
            "b": a["a"] * b["b"] + a["b"] * b["a"],
        }
        if self._has_rest():
            out["rest"] = a["rest"] @ b["rest"]
        return out

    def inverse(self, a: Element) -> Element:
        r2 = a["a"] ** 2 + a["b"] ** 2
        out = {"a": a["a"] / r2, "b": -a["b"] / r2}
        if self._has_rest():
            out["rest"] = lu_inv(a["rest"])
        return out

    def sample(self, seed=None, *, batch=(), dtype=torch.float64, device=None, cond=10.0) -> Element:
        gen = make_generator(seed)
        k = self.rot // 2
        r = log_uniform(gen, (*batch, k), cond, torch.float64)
        theta = torch.rand(*batch, k, generator=gen, dtype=torch.float64) * 2 * math.pi
        out = {"a": (r * theta.cos()).to(dtype=dtype, device=device), "b": (r * theta.sin()).to(dtype=dtype, device=device)}
        if self._has_rest():
            out["rest"] = GL(self.size - self.rot).sample(gen, batch=batch, dtype=dtype, device=device, cond=cond)["matrix"]
        return out

    def apply(self, a: Element, x: torch.Tensor, path: Path = (), variance: Variance = "co") -> torch.Tensor:
        self._check_path(path)
        av = a["a"].to(device=x.device, dtype=x.dtype)
        bv = a["b"].to(device=x.device, dtype=x.dtype)
        nb = av.ndim - 1
        flat, rest_shape = _flatten_rest(x, nb)
        i1, i2 = (p.to(x.device) for p in self.pairs)
        x1 = flat.index_select(-2, i1)
        x2 = flat.index_select(-2, i2)
        if variance == "contra":
            r2 = av**2 + bv**2
            av, bv = av / r2, bv / r2
        if variance == "abs":
            av, bv = av.abs(), bv.abs()
            y1 = av.unsqueeze(-1) * x1 + bv.unsqueeze(-1) * x2
        else:
            y1 = av.unsqueeze(-1) * x1 - bv.unsqueeze(-1) * x2
        y2 = bv.unsqueeze(-1) * x1 + av.unsqueeze(-1) * x2
        y = torch.empty_like(flat)
        y.index_copy_(-2, i1, y1)
        y.index_copy_(-2, i2, y2)
        if self._has_rest():
            m = a["rest"].to(device=x.device, dtype=x.dtype)
            xr = flat[..., self.rot :, :]
            if variance == "contra":
                yr = lu_inv(m).mT @ xr
            elif variance == "abs":
                yr = m.abs() @ xr
            else:
                yr = m @ xr
            y[..., self.rot :, :] = yr
        return _restore(y, rest_shape)

    def contains_matrix(self, m: torch.Tensor, atol: float = 1e-8) -> bool:
        if m.ndim < 2 or m.shape[-1] != self.size or m.shape[-2] != self.size or not torch.isfinite(m).all():
            return False
        i1, i2 = self.pairs
        expected = torch.zeros_like(m)
        a = m[..., i1, i1]
        b = m[..., i2, i1]
        ok = (m[..., i2, i2] - a).abs().le(atol).all() and (m[..., i1, i2] + b).abs().le(atol).all()
        if not ok or not ((a**2 + b**2) > atol**2).all():
            return False
        expected[..., i1, i1] = a
        expected[..., i2, i2] = a
        expected[..., i2, i1] = b
        expected[..., i1, i2] = -b
        if self._has_rest():
            expected[..., self.rot :, self.rot :] = m[..., self.rot :, self.rot :]
            if not GL(self.size - self.rot).contains_matrix(m[..., self.rot :, self.rot :], atol):
                return False
        return bool(((m - expected).abs() <= atol).all())
