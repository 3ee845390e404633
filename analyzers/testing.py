"""Oracles for barrier tests, in your own test suite as in symspec's.

- :func:`planted_pair`: B = g·A for a random element g of a spec's group, acting on
  A's canonical form, with g's inverse applied to B as the perfect alignment. The
  barrier of (A, B) is positive for a trained A (the straight line leaves the
  symmetry orbit), and that of (A, g⁻¹·B) is zero to numerical precision. Any
  aligner must bring B back to the latter.
- :func:`fit`: a few optimiser steps on an :class:`~symspec.data.EvalData`
  split, enough for a tiny model's loss to fall well below chance, so that
  interpolating away from it costs something measurable.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs
import torch

from symspec.data import EvalData, call_model
from symspec.planting import plant
from symspec.transforms import apply_elements, inverse_elements


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
    """B = g·A for a random g (seeded; all spaces of ``spec`` unless ``spaces``), as state
    dicts of A's canonical module (:func:`symspec.plant` computes g·A in float64 and casts
    back to the model's dtype). ``spec``: a Spec, a spec path or a built-in name."""

    p = plant(model, spec, seed=seed, spaces=spaces, cond=cond)
    problem = p.bound.problem
    sd_a = {k: v.detach() for k, v in p.canonical.state_dict().items()}
    sd_b = {k: v.detach() for k, v in p.model.state_dict().items()}
    wide = {k: v.double() if v.is_floating_point() else v for k, v in sd_b.items()}
    back = apply_elements(problem, inverse_elements(problem, p.elements), wide)
    back = {k: v.to(sd_a[k].dtype) if v.is_floating_point() else v for k, v in back.items()}
    return Planted(p.canonical, sd_a, sd_b, back, p.elements)


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
