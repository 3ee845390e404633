"""Toy alignment methods registered by tests: the registry is the only seam a method needs.

- :class:`Identity`: no alignment, in canonical form (elements are the identity);
- :class:`Oracle`: aligns each planted pair B = g·A by its own g^-1 (known answers), the
  pair recognised by B's weights.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs
import torch

from symspec.alignment import Alignment, AlignOptions, Endpoint
from symspec.problem import Problem


@attrs.frozen
class Identity:
    name: str = "identity"
    label: str = "identity (test)"
    canonical: bool = True
    needs_data: bool = False
    needs_module: bool = False
    groups: str | None = None
    calls: list[str] = attrs.field(factory=list, eq=False)

    def align(self, problem: Problem, a: Endpoint, b: Endpoint, options: AlignOptions) -> Alignment:
        self.calls.append(",".join(sorted(problem.spaces)))
        return Alignment(elements={}, history=[0.0], info={"toy": True})


@attrs.frozen
class Oracle:
    """``planted``: objects with ``sd_b`` (B's canonical weights) and ``elements`` (g)."""

    planted: Sequence[Any] = ()
    key: str = "lm_head.weight"
    name: str = "planted"
    label: str = "planted"
    canonical: bool = True
    needs_data: bool = False
    needs_module: bool = False
    groups: str | None = None

    def align(self, problem: Problem, a: Endpoint, b: Endpoint, options: AlignOptions) -> Alignment:
        from symspec.transforms import inverse_elements

        for p in self.planted:
            if torch.allclose(b.state[self.key].double(), p.sd_b[self.key].double(), rtol=0, atol=1e-6):
                return Alignment(elements=inverse_elements(problem, p.elements), history=[0.0])
        raise AssertionError("the oracle does not know this pair")
