"""Planted copies: B = g·A for a random element g of a spec's group, as a model of A's class.

The oracle behind every alignment test (an aligner must bring B back to A) and the
quickest way to see a symmetry at work. Acting on a state dict alone is not enough when
the spec unties weights (a tied output head becomes its own parameter): the module must
be untied too, or loading the transformed weights writes one tied side over the other
and B silently computes something else. :func:`plant` does both.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs
import torch

from .binding import BoundSpec, bind
from .groups import Element
from .spec import load_spec
from .spec.model import Spec
from .transforms import apply_elements, canonicalize_model, canonicalize_state_dict, sample_elements


@attrs.frozen
class PlantedCopy:
    """``model``: B = g·A, a model of A's class (untied where the spec unties), in A's
    dtype; ``canonical``: A in canonical form (same class), the model B is g·of;
    ``elements``: g, one element per space (float64); ``bound``: the spec bound to A."""

    model: torch.nn.Module
    canonical: torch.nn.Module
    elements: dict[str, Element]
    bound: BoundSpec


def plant(model: torch.nn.Module, spec: Any, *, seed: int = 0, spaces: Sequence[str] | None = None,
          cond: float = 10.0) -> PlantedCopy:
    """A planted copy of ``model``: its canonical form acted on by a random element of
    ``spec``'s group (seeded; every space unless ``spaces`` names some; GL elements with
    condition number at most ``cond``). The action is computed in float64 and cast back
    to each tensor's dtype; ``model`` is not modified.

    ``spec``: a Spec, a BoundSpec, a spec path or a built-in name.

    >>> import torch, symspec
    >>> from symspec.loading import import_file
    >>> ng = import_file("examples/nanogpt.py")
    >>> a = ng.build(n_layer=1, n_head=2, n_embd=8, n_ff=16, vocab_size=11, block_size=8).eval()
    >>> b = symspec.plant(a, "nanogpt", seed=1).model
    >>> x = ng.example_inputs(a)
    >>> bool(torch.allclose(a(*x), b(*x), atol=1e-5))  # same function
    True
    >>> bool(torch.allclose(a.lm_head.weight, b.lm_head.weight))  # other weights
    False
    >>> b.lm_head.weight is b.transformer.wte.weight  # the spec unties the head: so does B
    False
    """
    if isinstance(spec, BoundSpec):
        bound = spec
    else:
        bound = bind(spec if isinstance(spec, Spec) else load_spec(str(spec) if isinstance(spec, Path) else spec), model)
    problem = bound.problem
    canonical = canonicalize_model(bound, model).eval()
    state = {k: v.detach() for k, v in model.state_dict().items()}
    wide = {k: v.double() if v.is_floating_point() else v for k, v in canonicalize_state_dict(bound, state).items()}
    g = sample_elements(problem, list(spaces) if spaces is not None else None, seed=seed, cond=cond)
    moved = apply_elements(problem, g, wide)
    planted = copy.deepcopy(canonical)
    own = planted.state_dict()
    planted.load_state_dict({k: moved[k].to(own[k].dtype) if own[k].is_floating_point() else moved[k] for k in own})
    return PlantedCopy(planted, canonical, g, bound)
