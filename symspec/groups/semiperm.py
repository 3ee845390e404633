"""Semi-permutations: the M x N relation (M >= N) that splits N units into M.

Not a group (it changes widths), but the relation that width-changing alignment and
head splitting use (DESIGN §1): an M x N matrix T, every column stochastic (an old
unit's weight is shared among its copies) and every row with at most one positive entry
(a new unit copies at most one old unit). A layer ``h = act(W_in x)``, ``y = W_out h``
widened by T keeps its function with ``W_in' = support(T) W_in`` and
``W_out' = W_out T^T``, for any elementwise activation; positively homogeneous
activations (ReLU) may instead scale the input side.
"""

from __future__ import annotations

import ast

import attrs
import torch

from ..errors import GroupError
from .base import make_generator, positive


@attrs.frozen
class SemiPermutation:
    """The set of M x N semi-permutation matrices; text form ``SemiPerm(M, N)``.

    >>> sp = SemiPermutation(5, 3)
    >>> t = sp.sample(0)
    >>> sp.contains(t), tuple(t.shape)
    (True, (5, 3))
    >>> SemiPermutation.parse(str(sp)) == sp
    True
    """

    m: int = attrs.field(validator=positive)
    n: int = attrs.field(validator=positive)

    def __attrs_post_init__(self) -> None:
        if self.m < self.n:
            raise ValueError(f"a semi-permutation needs M >= N, got {self.m} x {self.n}")

    def __str__(self) -> str:
        return f"SemiPerm({self.m}, {self.n})"

    @classmethod
    def parse(cls, text: str) -> SemiPermutation:
        try:
            node = ast.parse(text.strip(), mode="eval").body
        except SyntaxError as e:
            raise GroupError(f"cannot parse '{text}': {e.msg}") from None
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "SemiPerm"):
            raise GroupError(f"'{text}' is not a semi-permutation relation SemiPerm(M, N)")
        try:
            args = [ast.literal_eval(a) for a in node.args]
            return cls(*args)
        except (ValueError, TypeError) as e:
            raise GroupError(f"SemiPerm: {e}") from None

    def sample(self, seed: int | torch.Generator | None = None, *, dtype: torch.dtype = torch.float64) -> torch.Tensor:
        """Every old unit gets at least one copy; extra copies go to random units, with
        Dirichlet-like random shares."""
        gen = make_generator(seed)
        owner = torch.cat([torch.randperm(self.n, generator=gen), torch.randint(self.n, (self.m - self.n,), generator=gen)])
        owner = owner[torch.randperm(self.m, generator=gen)]
        w = torch.rand(self.m, generator=gen, dtype=torch.float64) + 0.1
        t = torch.zeros(self.m, self.n, dtype=torch.float64)
        t[torch.arange(self.m), owner] = w
        t = t / t.sum(0, keepdim=True)
        return t.to(dtype)

    def contains(self, t: torch.Tensor, atol: float = 1e-8) -> bool:
        if t.shape != (self.m, self.n) or not torch.isfinite(t).all() or (t < -atol).any():
            return False
        positive_per_row = (t > atol).sum(1)
        if (positive_per_row > 1).any():
            return False
        return bool(((t.sum(0) - 1).abs() <= atol).all())

    @staticmethod
    def support(t: torch.Tensor, atol: float = 1e-12) -> torch.Tensor:
        """The 0/1 copy pattern of T."""
        return (t > atol).to(t.dtype)
