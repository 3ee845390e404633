"""Test oracles for users' own test suites.

>>> import torch
>>> from symspec.testing import assert_invariant  # doctest: +SKIP
>>> assert_invariant(model, "nanogpt", inputs)  # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from .checker import CheckReport, check
from .spec.load import load_spec
from .spec.model import Spec


def _spec(spec: Spec | str | Path) -> Spec:
    return spec if isinstance(spec, Spec) else load_spec(spec)


def assert_invariant(model: torch.nn.Module, spec: Spec | str | Path, inputs: Any, *, samples: int = 3, seed: int = 0,
                     dtypes: Sequence[str] = ("float64", "float32"), rtol: Mapping[str, float] | None = None,
                     spaces: Sequence[str] | None = None) -> CheckReport:
    """Raise AssertionError, with the check table, unless every symmetry of ``spec``
    (and its canonicalisation) preserves ``model``'s function on ``inputs``."""
    report = check(model, _spec(spec), inputs, samples=samples, seed=seed, dtypes=dtypes, rtol=rtol, spaces=spaces)
    if not report.passed:
        raise AssertionError("symmetries not preserved:\n" + report.render())
    return report


def assert_not_invariant(model: torch.nn.Module, spec: Spec | str | Path, inputs: Any, **kw: Any) -> CheckReport:
    """The negative oracle: raise AssertionError if the check passes (a wrong spec must fail)."""
    report = check(model, _spec(spec), inputs, **kw)
    if report.passed:
        raise AssertionError("expected the check to fail, but every row passed:\n" + report.render())
    return report


def randomize_(model: torch.nn.Module, seed: int = 0, scale: float = 0.2) -> torch.nn.Module:
    """Perturb every parameter in place, so that no weight sits at a special value
    (LayerNorm gains of exactly 1, zero biases) that could hide a wrong symmetry."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        seen: set[int] = set()
        for _, p in model.named_parameters():
            if id(p) in seen or not p.is_floating_point():
                continue
            seen.add(id(p))
            s = float(p.std()) if p.numel() > 1 else 0.0
            s = s if s > 0 else 1.0
            p.add_(torch.randn(p.shape, generator=g, dtype=torch.float64).to(p.dtype) * scale * s)
    return model
