"""Test oracles for users' own test suites.

>>> import torch
>>> from symspec.testing import assert_invariant  # doctest: +SKIP
>>> assert_invariant(model, "nanogpt", inputs)  # doctest: +SKIP

A new group kind checks its own laws with :func:`check_group`:

>>> from symspec.groups import parse
>>> check_group(parse("Heads(2, qk=GL(3), ov=O(3))"))
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from .checker import CheckReport, check
from .errors import GroupError
from .groups import Element, Group, parse
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


def check_group(group: Group, *, elements: Sequence[Element] | None = None, rtol: float = 1e-9) -> None:
    """Raise AssertionError, naming every law broken and on which elements, unless
    ``group`` behaves as a group acting linearly on tensors (as escnn's groups check
    themselves): its text form round-trips; on its :meth:`~symspec.groups.Group.testing_elements`
    (or ``elements``), the first is the identity, every one is a member, the identity,
    inverse and associativity laws hold, ``matrix(compose(a, b)) == matrix(a) @ matrix(b)``
    on every representation, ``apply`` acts as ``matrix`` in every variance (``contra``
    the inverse transpose, ``abs`` the entrywise absolute value, both for orthogonal
    representations equal to ``co`` where they say so), seeded samples repeat, and the
    zero matrix is no member. Comparisons are in float64, relative to the matrices' size."""
    es = list(group.testing_elements() if elements is None else elements)
    broken: list[str] = []
    _check_text(group, broken)
    if not es:
        broken.append("testing_elements: no elements")
    else:
        _check_members(group, es, broken)
        _check_laws(group, es, broken)
        _check_action(group, es, broken)
    if broken:
        raise AssertionError(f"{group} is not a valid group:\n" + "\n".join(f"  {b}" for b in _first_per_law(broken)))


def _first_per_law(broken: list[str], most: int = 3) -> list[str]:
    """The first ``most`` failures of each law (the text before the first colon), in order."""
    shown: list[str] = []
    counts: dict[str, int] = {}
    for line in broken:
        law = line.split(":", 1)[0]
        counts[law] = counts.get(law, 0) + 1
        if counts[law] <= most:
            shown.append(line)
        elif counts[law] == most + 1:
            shown.append(f"{law}: ... and more")
    return shown


def _mats(group: Group, a: Element, variance: str = "co") -> list[torch.Tensor]:
    return [group.matrix(a, p, variance).to(torch.float64) for p in group.rep_paths()]  # type: ignore[arg-type]


def _close(x: torch.Tensor, y: torch.Tensor, rtol: float = 1e-9) -> bool:
    if x.shape != y.shape:
        return False
    scale = max(1.0, float(y.abs().max()) if y.numel() else 1.0)
    return bool(torch.allclose(x.to(torch.float64), y.to(torch.float64), rtol=0, atol=rtol * scale * max(1, y.shape[-1])))


def _same(group: Group, a: Element, b: Element) -> bool:
    return all(_close(x, y) for x, y in zip(_mats(group, a), _mats(group, b)))


def _check_text(group: Group, broken: list[str]) -> None:
    try:
        back = parse(str(group))
    except GroupError as e:
        broken.append(f"text form: parse({str(group)!r}) fails: {e}")
        return
    if back != group or hash(back) != hash(group):
        broken.append(f"text form: parse({str(group)!r}) gives {back}, another group")


def _check_members(group: Group, es: list[Element], broken: list[str]) -> None:
    if not _same(group, es[0], group.identity()):
        broken.append("testing_elements: the first element is not the identity")
    for i, e in enumerate(es):
        if not group.contains(e):
            broken.append(f"membership: testing element {i} is not a member")
        try:
            if not group.contains_matrix(group.matrix(e)):
                broken.append(f"membership: the matrix of testing element {i} is not a member")
        except GroupError:  # a kind that tests membership on elements only (multi-part heads)
            pass
    try:
        if group.contains_matrix(torch.zeros(group.n, group.n, dtype=torch.float64)):
            broken.append("membership: the zero matrix (no invertible map) is accepted")
    except GroupError:
        pass
    if not _same(group, group.sample(7), group.sample(7)):
        broken.append("sample: the same seed gives different elements")
    if not group.contains(group.sample(7)):
        broken.append("sample: a sampled element is not a member")


def _check_laws(group: Group, es: list[Element], broken: list[str]) -> None:
    one = group.identity()
    for i, a in enumerate(es):
        if not (_same(group, group.compose(a, one), a) and _same(group, group.compose(one, a), a)):
            broken.append(f"identity: compose with the identity changes testing element {i}")
        inv = group.inverse(a)
        if not (_same(group, group.compose(a, inv), one) and _same(group, group.compose(inv, a), one)):
            broken.append(f"inverse: testing element {i} composed with its inverse is not the identity")
    for (i, a), (j, b) in itertools.product(enumerate(es), repeat=2):
        ab = _mats(group, group.compose(a, b))
        for p, m, ma, mb in zip(group.rep_paths(), ab, _mats(group, a), _mats(group, b)):
            if not _close(m, ma @ mb):
                broken.append(f"composition: matrix(compose({i}, {j})) != matrix({i}) @ matrix({j}) on path {p}")
    few = list(enumerate(es))[1:4] or list(enumerate(es))
    for (i, a), (j, b), (k, c) in itertools.product(few, repeat=3):
        if not _same(group, group.compose(group.compose(a, b), c), group.compose(a, group.compose(b, c))):
            broken.append(f"associativity: ({i} {j}) {k} != {i} ({j} {k})")


def _check_action(group: Group, es: list[Element], broken: list[str]) -> None:
    gen = torch.Generator().manual_seed(0)
    for (i, a), p in itertools.product(enumerate(es), group.rep_paths()):
        size = group.rep_size(p)
        co = group.matrix(a, p, "co").to(torch.float64)
        if tuple(co.shape) != (size, size):
            broken.append(f"matrix: element {i} on path {p} is {tuple(co.shape)}, the representation has size {size}")
            continue
        expected = {"co": co, "contra": torch.linalg.inv(co).mT, "abs": co.abs()}
        if group.is_orthogonal(p) and not _close(expected["contra"], co):
            broken.append(f"is_orthogonal: path {p} says orthogonal, but element {i}'s matrix is not")
        x = torch.randn(size, 2, 3, generator=gen, dtype=torch.float64)
        for variance, m in expected.items():
            if not _close(group.matrix(a, p, variance).to(torch.float64), m):  # type: ignore[arg-type]
                broken.append(f"matrix: element {i}, path {p}, {variance} is not {variance} of its co matrix")
            y = group.apply(a, x, p, variance)  # type: ignore[arg-type]
            if not _close(y, torch.einsum("ij,jkl->ikl", m, x)):
                broken.append(f"action: apply(element {i}, path {p}, {variance}) is not its matrix times the tensor")
