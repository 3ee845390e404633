"""The elementary groups that move entries: permutations, signed permutations, the trivial
group and signs (the continuous ones are in :mod:`symspec.groups.continuous`).

Every element may carry leading batch dimensions (one element per head, say); the
operations broadcast over them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar

import attrs
import torch

from .base import Element, Group, Path, Variance, int_field, make_generator, register


def _flatten_rest(x: torch.Tensor, nbatch: int) -> tuple[torch.Tensor, tuple[int, ...]]:
    """[*b, n, *rest] -> [*b, n, prod(rest)], and the rest shape to restore."""
    rest = tuple(x.shape[nbatch + 1 :])
    return x.reshape(*x.shape[: nbatch + 1], -1), rest


def _restore(y: torch.Tensor, rest: tuple[int, ...]) -> torch.Tensor:
    return y.reshape(*y.shape[:-1], *rest)


def _transposed(x: torch.Tensor) -> bool:
    """A 2-d view of a contiguous matrix's transpose (an input axis moved to the front)."""
    return x.ndim == 2 and not x.is_contiguous() and x.mT.is_contiguous()


def _gather_rows(x: torch.Tensor, perm: torch.Tensor) -> torch.Tensor:
    """y[..., i, :] = x[..., perm[..., i], :] for x [*b, n, R] and perm [*b, n]."""
    if perm.ndim == 1:
        if _transposed(x):
            # columns of the contiguous transpose: gather is ~5x faster than index_select(-1)
            xt = x.mT
            return torch.gather(xt, -1, perm.to(x.device).expand(xt.shape[0], -1)).mT
        return x.index_select(-2, perm.to(x.device))
    idx = perm.to(x.device).unsqueeze(-1).expand(*perm.shape, x.shape[-1])
    return torch.gather(x, -2, idx)


def _is_perm(p: torch.Tensor) -> bool:
    n = p.shape[-1]
    return bool((torch.sort(p, dim=-1).values == torch.arange(n, device=p.device)).all())


def _perm_matrix_ok(m: torch.Tensor, atol: float, signed: bool) -> bool:
    if m.ndim < 2 or m.shape[-1] != m.shape[-2]:
        return False
    vals = m.abs() if signed else m
    binary = ((vals - 1).abs() <= atol) | (vals.abs() <= atol)
    if not binary.all():
        return False
    if not signed and (m < -atol).any():
        return False
    nz = (vals > 0.5).to(torch.int64)
    return bool((nz.sum(-1) == 1).all() and (nz.sum(-2) == 1).all())


@register
@attrs.frozen
class S(Group):
    """Permutations S(n): FF hidden units under any elementwise activation, heads."""

    kind: ClassVar[str] = "S"
    size: int = int_field()

    @property
    def n(self) -> int:
        return self.size

    def is_orthogonal(self, path: Path = ()) -> bool:
        return True

    def identity(self, *, batch=(), dtype=torch.float64, device=None) -> Element:
        return {"perm": torch.arange(self.size, device=device).expand(*batch, self.size).clone()}

    def compose(self, a: Element, b: Element) -> Element:
        return {"perm": torch.gather(b["perm"], -1, a["perm"])}

    def inverse(self, a: Element) -> Element:
        return {"perm": torch.argsort(a["perm"], dim=-1)}

    def sample(self, seed=None, *, batch=(), dtype=torch.float64, device=None, cond=10.0) -> Element:
        gen = make_generator(seed)
        perm = torch.argsort(torch.rand(*batch, self.size, generator=gen), dim=-1)
        return {"perm": perm.to(device)}

    def apply(self, a: Element, x: torch.Tensor, path: Path = (), variance: Variance = "co") -> torch.Tensor:
        self._check_path(path)
        nb = a["perm"].ndim - 1
        flat, rest = _flatten_rest(x, nb)
        return _restore(_gather_rows(flat, a["perm"]), rest)

    def element_ok(self, a: Element, atol: float) -> bool:
        return set(a) == {"perm"} and a["perm"].shape[-1] == self.size and _is_perm(a["perm"])

    def permutation_subgroup(self) -> Group:
        return self

    def contains_matrix(self, m: torch.Tensor, atol: float = 1e-8) -> bool:
        return m.shape[-1] == self.size and _perm_matrix_ok(m, atol, signed=False)


@register
@attrs.frozen
class SP(Group):
    """Signed permutations SP(n): the residual of an RMSNorm model whose gain is not folded."""

    kind: ClassVar[str] = "SP"
    size: int = int_field()

    @property
    def n(self) -> int:
        return self.size

    def is_orthogonal(self, path: Path = ()) -> bool:
        return True

    def identity(self, *, batch=(), dtype=torch.float64, device=None) -> Element:
        return {
            "perm": torch.arange(self.size, device=device).expand(*batch, self.size).clone(),
            "sign": torch.ones(*batch, self.size, dtype=dtype, device=device),
        }

    def compose(self, a: Element, b: Element) -> Element:
        return {
            "perm": torch.gather(b["perm"], -1, a["perm"]),
            "sign": a["sign"] * torch.gather(b["sign"], -1, a["perm"]),
        }

    def inverse(self, a: Element) -> Element:
        inv = torch.argsort(a["perm"], dim=-1)
        return {"perm": inv, "sign": torch.gather(a["sign"], -1, inv)}

    def sample(self, seed=None, *, batch=(), dtype=torch.float64, device=None, cond=10.0) -> Element:
        gen = make_generator(seed)
        perm = torch.argsort(torch.rand(*batch, self.size, generator=gen), dim=-1)
        sign = torch.where(torch.rand(*batch, self.size, generator=gen) < 0.5, -1.0, 1.0)
        return {"perm": perm.to(device), "sign": sign.to(dtype=dtype, device=device)}

    def apply(self, a: Element, x: torch.Tensor, path: Path = (), variance: Variance = "co") -> torch.Tensor:
        self._check_path(path)
        nb = a["perm"].ndim - 1
        flat, rest = _flatten_rest(x, nb)
        y = _gather_rows(flat, a["perm"])
        if variance != "abs":
            y = y * a["sign"].to(device=y.device, dtype=y.dtype).unsqueeze(-1)
        return _restore(y, rest)

    def element_ok(self, a: Element, atol: float) -> bool:
        return (
            set(a) == {"perm", "sign"}
            and a["perm"].shape[-1] == self.size
            and _is_perm(a["perm"])
            and bool(((a["sign"].abs() - 1).abs() <= atol).all())
        )

    def contains_matrix(self, m: torch.Tensor, atol: float = 1e-8) -> bool:
        return m.shape[-1] == self.size and _perm_matrix_ok(m, atol, signed=True)

    def permutation_subgroup(self) -> Group:
        return S(self.size)

    def embed(self, sub: Group, a: Element, dtype: torch.dtype = torch.float64) -> Element:
        if isinstance(sub, S):  # every sign +1
            return {"perm": a["perm"], "sign": torch.ones(a["perm"].shape, dtype=dtype, device=a["perm"].device)}
        return super().embed(sub, a, dtype)


@register
@attrs.frozen
class Id(Group):
    """The trivial group Id(n), the identity only: units that may not be transformed
    (heads that may only be permuted: ``Heads(12, Id(64))``); also what a solver's
    restriction to permutations leaves of a group that has none (GL within heads, D)."""

    kind: ClassVar[str] = "Id"
    size: int = int_field()

    @property
    def n(self) -> int:
        return self.size

    def is_orthogonal(self, path: Path = ()) -> bool:
        return True

    def identity(self, *, batch=(), dtype=torch.float64, device=None) -> Element:
        # one empty field: an element is still a dict of tensors with batch dimensions
        return {"unit": torch.zeros(*batch, 0, dtype=dtype, device=device)}

    def compose(self, a: Element, b: Element) -> Element:
        return {"unit": a["unit"]}

    def inverse(self, a: Element) -> Element:
        return {"unit": a["unit"]}

    def sample(self, seed=None, *, batch=(), dtype=torch.float64, device=None, cond=10.0) -> Element:
        return self.identity(batch=batch, dtype=dtype, device=device)

    def apply(self, a: Element, x: torch.Tensor, path: Path = (), variance: Variance = "co") -> torch.Tensor:
        self._check_path(path)
        return x

    def contains_matrix(self, m: torch.Tensor, atol: float = 1e-8) -> bool:
        if m.ndim < 2 or m.shape[-1] != self.size or m.shape[-2] != self.size:
            return False
        eye = torch.eye(self.size, dtype=m.dtype, device=m.device)
        return bool(((m - eye).abs() <= atol).all())

    def is_trivial(self) -> bool:
        return True

    def permutation_subgroup(self) -> Group:
        return self

    def best_fit(self, cross: torch.Tensor, gram: Callable[[], torch.Tensor]) -> torch.Tensor:
        """``tr C``: with the identity ||a - b||^2 = ||a||^2 - 2 tr C + tr G, and the sum of
        tr G over a pairing does not depend on it. Exact, and linear in C."""
        return torch.diagonal(cross, dim1=-2, dim2=-1).sum(-1)


@register
@attrs.frozen
class Sign(Group):
    """A global sign {I, -I} acting on all n dims at once: with S(n), the residual of a
    post-LayerNorm model (BERT), where LayerNorm(-y) = -LayerNorm(y) but no per-dim sign
    or rotation commutes with the centring."""

    kind: ClassVar[str] = "Sign"
    size: int = int_field()

    @property
    def n(self) -> int:
        return self.size

    def is_orthogonal(self, path: Path = ()) -> bool:
        return True

    def identity(self, *, batch=(), dtype=torch.float64, device=None) -> Element:
        return {"sign": torch.ones(batch, dtype=dtype, device=device)}

    def compose(self, a: Element, b: Element) -> Element:
        return {"sign": a["sign"] * b["sign"]}

    def inverse(self, a: Element) -> Element:
        return {"sign": a["sign"].clone()}

    def sample(self, seed=None, *, batch=(), dtype=torch.float64, device=None, cond=10.0) -> Element:
        gen = make_generator(seed)
        sign = torch.where(torch.rand(batch, generator=gen) < 0.5, -1.0, 1.0)
        return {"sign": sign.to(dtype=dtype, device=device)}

    def apply(self, a: Element, x: torch.Tensor, path: Path = (), variance: Variance = "co") -> torch.Tensor:
        self._check_path(path)
        if variance == "abs":
            return x
        s = a["sign"].to(device=x.device, dtype=x.dtype)
        return x * s.reshape(*s.shape, *([1] * (x.ndim - s.ndim)))

    def element_ok(self, a: Element, atol: float) -> bool:
        return set(a) == {"sign"} and bool(((a["sign"].abs() - 1).abs() <= atol).all())

    def permutation_subgroup(self) -> Group:
        return Id(self.size)

    def contains_matrix(self, m: torch.Tensor, atol: float = 1e-8) -> bool:
        if m.ndim < 2 or m.shape[-1] != self.size or m.shape[-2] != self.size:
            return False
        eye = torch.eye(self.size, dtype=m.dtype, device=m.device)
        return bool(((m - eye).abs() <= atol).all() or ((m + eye).abs() <= atol).all())
