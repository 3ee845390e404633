"""Oracles for barrier tests, in your own test suite as in symspec's.

- :func:`planted_pair`: B = g·A for a random element g of a spec's group, acting on
  A's canonical form, with g's inverse applied to B as the perfect alignment. The
  barrier of (A, B) is positive for a trained A (the straight line leaves the
  symmetry orbit), and that of (A, g⁻¹·B) is zero to numerical precision. Any
  aligner must bring B back to the latter.
- :func:`fit`: a few optimiser steps on an :class:`~symspec.analyzers.data.EvalData`
  split, enough for a tiny model's loss to fall well below chance, so that
  interpolating away from it costs something measurable.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

import attrs
import torch

from .data import EvalData, call_model


@attrs.frozen
class Planted:
    """A planted pair in canonical form: evaluate ``sd_a``, ``sd_b`` in ``module``."""

    module: torch.nn.Module
    sd_a: dict[str, torch.Tensor]
    sd_b: dict[str, torch.Tensor]
    aligned_b: dict[str, torch.Tensor]
    elements: dict[str, Any]


def planted_pair(model: torch.nn.Module, spec: Any, *, seed: int = 0, spaces: Sequence[str] | None = None,
                 cond: float = 10.0) -> Planted:
    """B = g·A for a random g (seeded; all spaces of ``spec`` unless ``spaces``), in float64
    and cast back to the model's dtype. ``spec``: a Spec, a spec path or a built-in name."""
    from symspec.binding import bind
    from symspec.spec import load_spec
    from symspec.spec.model import Spec
    from symspec.transforms import (
        apply_elements,
        canonicalize_model,
        inverse_elements,
        sample_elements,
    )

    s = spec if isinstance(spec, Spec) else load_spec(spec)
    dtype = next(model.parameters()).dtype
    base = copy.deepcopy(model).to(torch.float64).eval()
    bound = bind(s, base)
    canon = canonicalize_model(bound, base)
    problem = bound.problem
    sd_a = {k: v.detach() for k, v in canon.state_dict().items()}
    names = list(spaces) if spaces is not None else list(problem.spaces)
    g = sample_elements(problem, names, seed=seed, cond=cond)
    sd_b = apply_elements(problem, g, sd_a)
    back = apply_elements(problem, inverse_elements(problem, g), sd_b)

    def cast(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {k: v.to(dtype) if v.is_floating_point() else v for k, v in sd.items()}

    return Planted(canon.to(dtype), cast(sd_a), cast(sd_b), cast(back), g)


def fit(model: torch.nn.Module, data: EvalData, *, steps: int = 200, lr: float = 3e-3, seed: int = 0) -> list[float]:
    """Train ``model`` in place with Adam on ``data``'s batches (cycled), using ``data.loss``;
    returns the loss of every step."""
    torch.manual_seed(seed)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    model.train()
    losses = []
    for step in range(steps):
        inputs, targets = data.batches[step % len(data.batches)]
        loss = data.loss(call_model(model, inputs), targets)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    model.eval()
    return losses
