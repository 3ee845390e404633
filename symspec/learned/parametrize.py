"""Group elements as differentiable functions of free latents: what learned matching trains.

Every group kind registers a parametrisation beside its weight-matching solver
(``@parametrization("O")``): given the group, a starting element ``g0`` (weight
matching's) and the :class:`ParamSettings`, it builds a :class:`Param` whose
:meth:`~Param.element` is

- a genuine element of the group for every value of the latents (so the aligned B
  computes B's function at every step, and the interpolation path is one of the
  architecture's own models), except for Sinkhorn's soft permutations, which are
  hardened by :meth:`~Param.project`;
- equal to ``g0`` when the latents are at their starting values;
- differentiable in the latents (autograd through the group's own ``apply``).

The kinds:

- ``O``: ``g0 exp(X - X^T)`` (``orthogonal="exp"``) or the polar factor of a free
  latent started at ``g0`` (``"polar"``, a differentiable Newton-Schulz iteration);
  ``OC``: the same inside the zero-mean subspace (``B R B^T + 11^T/n`` with B an
  orthonormal basis of it), so the all-ones direction stays fixed;
- ``GL``: ``g0 exp(X)``, invertible by construction (its condition number is tracked);
- ``D``/``Dpos``: ``d0 exp(l)`` (the signs of D stay those of ``d0``);
- ``RoPE``: per frequency pair ``(a0 + i b0) exp(u + i v)``, and ``rest0 exp(X)`` on
  unrotated dimensions;
- permutations (``S``, the head permutation of ``Heads``): frozen at ``g0``
  (``permutations="frozen"``, the default), a straight-through estimator through the
  assignment (``"ste"``: the forward pass uses the hard permutation that maximises a
  score latent started at ``g0``, the backward pass treats it as the score matrix), or
  Sinkhorn soft permutations annealed to hard (``"sinkhorn"``: doubly stochastic
  matrices at a temperature lowered geometrically, hardened by an assignment);
- ``Heads``: the head permutation as above (key/value groups; the order of query heads
  inside a group stays ``g0``'s), every part's within-head elements by their own kind,
  batched over heads;
- ``Id``, ``Sign``, ``SP``: frozen (nothing continuous to learn).

A soft or straight-through permutation acts through :meth:`Param.action`, a dense
matrix applied in place of the group's ``apply`` (for a permutation matrix every
variance acts the same way), which :func:`symspec.transforms.apply_elements` takes as
``actions``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs
import torch

from ..groups import Element, Group, Path, Variance, kind_entry
from ..groups.continuous import OC, centred_basis
from ..groups.heads import Heads
from ..solvers.engine.base import SolverError
from ..solvers.kinds.assignment import assign
from ..transforms.apply import Action

ORTHOGONAL = ("exp", "polar")
PERMUTATIONS = ("frozen", "ste", "sinkhorn")


@attrs.frozen
class ParamSettings:
    """How elements are parametrised. ``orthogonal``: ``exp`` or ``polar`` (O and OC).
    ``permutations``: ``frozen``, ``ste`` or ``sinkhorn``. ``temperature``: Sinkhorn's
    (start, end), lowered geometrically over the run. ``sinkhorn_iters``: normalisation
    sweeps per step. ``device``: where the latents live (float64)."""

    orthogonal: str = attrs.field(default="exp", validator=attrs.validators.in_(ORTHOGONAL))
    permutations: str = attrs.field(default="frozen", validator=attrs.validators.in_(PERMUTATIONS))
    temperature: tuple[float, float] = (0.1, 0.005)
    sinkhorn_iters: int = 20
    device: str | torch.device = "cpu"


class Param:
    """One space's learned element (the base class is a frozen one: ``Id``, ``Sign``, ...)."""

    def __init__(self, group: Group, start: Element, settings: ParamSettings) -> None:
        self.group = group
        self.start = {k: v.detach().to(settings.device) for k, v in start.items()}
        self.settings = settings

    def latents(self) -> list[torch.Tensor]:
        """The trainable tensors (leaves with ``requires_grad``)."""
        return []

    def element(self) -> Element:
        """The current element (differentiable in the latents)."""
        return self.start

    def action(self) -> Action | None:
        """A dense action replacing ``group.apply`` for this step (soft and
        straight-through permutations), or None."""
        return None

    def project(self) -> Element:
        """The current element, exactly in the group and detached."""
        return {k: v.detach().clone() for k, v in self.element().items()}

    def anneal(self, fraction: float) -> None:
        """Called before each step with the fraction of the run done."""

    def describe(self) -> dict[str, Any]:
        """JSON-able facts about the current element (condition numbers, moved units)."""
        return {}


Factory = Callable[[Group, Element, ParamSettings], Param]

#: group kind -> how its elements are parametrised
PARAMETRIZATIONS: dict[str, Factory] = {}


def parametrization(*kinds: str) -> Callable[[Factory], Factory]:
    """Register the parametrisation of group kinds (a class or function taking
    ``(group, start, settings)``)."""

    def deco(fn: Factory) -> Factory:
        for k in kinds:
            PARAMETRIZATIONS[k] = fn
        return fn

    return deco


def parametrize(group: Group, start: Element, settings: ParamSettings) -> Param:
    """The learned element of ``group``, started at ``start``."""
    factory = kind_entry(PARAMETRIZATIONS, group, "learned parametrisation", error=SolverError)
    return factory(group, start, settings)


parametrization("Id", "Sign", "SP")(Param)


def _latent(like: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(like, dtype=torch.float64).requires_grad_(True)


def _f64(e: Element) -> Element:
    return {k: (v.to(torch.float64) if v.is_floating_point() else v) for k, v in e.items()}


def _skew(x: torch.Tensor) -> torch.Tensor:
    return x - x.mT


def polar_newton_schulz(w: torch.Tensor, tol: float = 1e-13, max_iter: int = 60) -> torch.Tensor:
    """The orthogonal polar factor of ``w`` (square, batched), differentiable: Newton-Schulz
    ``X <- X (3 I - X^T X) / 2`` from ``w`` scaled to spectral norm 1 (the scale, which the
    polar factor does not depend on, is detached)."""
    scale = torch.linalg.matrix_norm(w.detach(), ord=2)[..., None, None]
    x = w / scale
    eye = torch.eye(w.shape[-1], dtype=w.dtype, device=w.device)
    for _ in range(max_iter):
        xtx = x.mT @ x
        if float((xtx.detach() - eye).abs().max()) < tol:
            break
        x = x @ (3 * eye - xtx) / 2
    return x


def polar_svd(m: torch.Tensor) -> torch.Tensor:
    """The nearest orthogonal matrix (U V^T of the SVD), detached: the exact projection."""
    u, _, vh = torch.linalg.svd(m.detach().to(torch.float64))
    return u @ vh


@parametrization("O")
class OrthogonalParam(Param):
    def __init__(self, group: Group, start: Element, settings: ParamSettings) -> None:
        super().__init__(group, _f64(start), settings)
        m0 = self.start["matrix"]
        self.x = (_latent(m0) if settings.orthogonal == "exp"
                  else m0.clone().requires_grad_(True))

    def latents(self) -> list[torch.Tensor]:
        return [self.x]

    def element(self) -> Element:
        if self.settings.orthogonal == "exp":
            return {"matrix": self.start["matrix"] @ torch.linalg.matrix_exp(_skew(self.x))}
        return {"matrix": polar_newton_schulz(self.x)}

    def project(self) -> Element:
        return {"matrix": polar_svd(self.element()["matrix"])}

    def describe(self) -> dict[str, Any]:
        m = self.project()["matrix"]
        angle = torch.linalg.eigvals(m @ self.start["matrix"].mT).angle().abs()
        return {"max_angle_from_start": float(angle.max()), "mean_angle_from_start": float(angle.mean())}


@parametrization("OC")
class CentredOrthogonalParam(OrthogonalParam):
    """O(n-1) inside the zero-mean subspace: ``g0 (B R B^T + 11^T/n)``."""

    def __init__(self, group: Group, start: Element, settings: ParamSettings) -> None:
        Param.__init__(self, group, _f64(start), settings)
        n = group.n
        self.basis = centred_basis(n).to(settings.device)
        self.ones = torch.full((n, n), 1.0 / n, dtype=torch.float64, device=settings.device)
        like = torch.zeros(n - 1, n - 1, dtype=torch.float64, device=settings.device)
        self.x = (like.clone() if settings.orthogonal == "exp"
                  else torch.eye(n - 1, dtype=torch.float64, device=settings.device)).requires_grad_(True)

    def _lift(self, r: torch.Tensor) -> torch.Tensor:
        return self.basis @ r @ self.basis.mT + self.ones

    def element(self) -> Element:
        r = (torch.linalg.matrix_exp(_skew(self.x)) if self.settings.orthogonal == "exp"
             else polar_newton_schulz(self.x))
        return {"matrix": self.start["matrix"] @ self._lift(r)}

    def project(self) -> Element:
        m = self.element()["matrix"].detach()
        return {"matrix": OC.from_reduced(polar_svd(self.basis.mT @ m @ self.basis))}


@parametrization("GL")
class LinearParam(Param):
    """``g0 exp(X)``: invertible for every X."""

    def __init__(self, group: Group, start: Element, settings: ParamSettings) -> None:
        super().__init__(group, _f64(start), settings)
        self.x = _latent(self.start["matrix"])

    def latents(self) -> list[torch.Tensor]:
        return [self.x]

    def element(self) -> Element:
        return {"matrix": self.start["matrix"] @ torch.linalg.matrix_exp(self.x)}

    def describe(self) -> dict[str, Any]:
        m = self.element()["matrix"].detach()
        return {"max_condition": float(torch.linalg.cond(m).max()),
                "max_condition_start": float(torch.linalg.cond(self.start["matrix"]).max())}


@parametrization("D", "Dpos")
class DiagonalParam(Param):
    """``d0 exp(l)``: the signs stay ``d0``'s, so Dpos stays positive."""

    def __init__(self, group: Group, start: Element, settings: ParamSettings) -> None:
        super().__init__(group, _f64(start), settings)
        self.x = _latent(self.start["diag"])

    def latents(self) -> list[torch.Tensor]:
        return [self.x]

    def element(self) -> Element:
        return {"diag": self.start["diag"] * torch.exp(self.x)}


@parametrization("RoPE")
class RotaryParam(Param):
    """Per frequency pair ``(a0 + i b0) exp(u + i v)``; unrotated dimensions ``rest0 exp(X)``."""

    def __init__(self, group: Group, start: Element, settings: ParamSettings) -> None:
        super().__init__(group, _f64(start), settings)
        self.u = _latent(self.start["a"])
        self.v = _latent(self.start["a"])
        self.rest = _latent(self.start["rest"]) if "rest" in self.start else None

    def latents(self) -> list[torch.Tensor]:
        return [self.u, self.v] + ([self.rest] if self.rest is not None else [])

    def element(self) -> Element:
        a0, b0 = self.start["a"], self.start["b"]
        r, c, s = torch.exp(self.u), torch.cos(self.v), torch.sin(self.v)
        out = {"a": r * (a0 * c - b0 * s), "b": r * (a0 * s + b0 * c)}
        if self.rest is not None:
            out["rest"] = self.start["rest"] @ torch.linalg.matrix_exp(self.rest)
        return out


def _one_hot(perm: torch.Tensor) -> torch.Tensor:
    """The matrix of ``y[i] = x[perm[i]]``: ``M[i, perm[i]] = 1``."""
    n = perm.shape[-1]
    m = torch.zeros(n, n, dtype=torch.float64, device=perm.device)
    m[torch.arange(n, device=perm.device), perm] = 1.0
    return m


def _log_sinkhorn(logits: torch.Tensor, iters: int) -> torch.Tensor:
    for _ in range(iters):
        logits = logits - torch.logsumexp(logits, dim=-1, keepdim=True)
        logits = logits - torch.logsumexp(logits, dim=-2, keepdim=True)
    return logits.exp()


class LearnedPermutation:
    """A permutation of ``n`` things learned by a straight-through estimator or Sinkhorn
    (``mode``), started at ``perm0``: :meth:`matrix` is the (soft or straight-through)
    matrix the forward pass applies, :meth:`hard` the permutation it stands for."""

    def __init__(self, perm0: torch.Tensor, mode: str, settings: ParamSettings) -> None:
        self.mode = mode
        self.settings = settings
        self.perm0 = perm0.detach().to(settings.device)
        self.z = _one_hot(self.perm0).requires_grad_(True)
        self.temperature = settings.temperature[0]

    def anneal(self, fraction: float) -> None:
        t0, t1 = self.settings.temperature
        self.temperature = t0 * (t1 / t0) ** min(max(fraction, 0.0), 1.0)

    def soft(self) -> torch.Tensor:
        return _log_sinkhorn(self.z / self.temperature, self.settings.sinkhorn_iters)

    def hard(self) -> torch.Tensor:
        score = self.soft() if self.mode == "sinkhorn" else self.z
        return assign(score.detach())

    def matrix(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(the matrix to act with, the hard permutation)."""
        perm = self.hard()
        if self.mode == "sinkhorn":
            return self.soft(), perm
        return _one_hot(perm) + (self.z - self.z.detach()), perm

    def moved(self) -> float:
        """The fraction of positions whose source differs from the start."""
        return float((self.hard() != self.perm0).double().mean())


def _dense(m: torch.Tensor) -> Action:
    def act(x: torch.Tensor, path: Path, variance: Variance) -> torch.Tensor:
        flat = x.reshape(m.shape[0], -1)
        return (m.to(x.dtype) @ flat).reshape(x.shape)

    return act


class _PermutationLatent(Param):
    """A parametrisation whose permutation ``perm`` may be learned (``self.learned``)."""

    learned: LearnedPermutation | None = None

    def learn_permutation(self, perm0: torch.Tensor, settings: ParamSettings, can: bool) -> None:
        """Learn ``perm0`` when the settings say so and ``can`` (a single permutation of
        more than one thing)."""
        self.learned = (LearnedPermutation(perm0, settings.permutations, settings)
                        if settings.permutations != "frozen" and can else None)

    def latents(self) -> list[torch.Tensor]:
        return [self.learned.z] if self.learned is not None else []

    def anneal(self, fraction: float) -> None:
        if self.learned is not None:
            self.learned.anneal(fraction)

    def perm(self) -> torch.Tensor:
        return self.learned.hard() if self.learned is not None else self.start["perm"]


@parametrization("S")
class PermutationParam(_PermutationLatent):
    def __init__(self, group: Group, start: Element, settings: ParamSettings) -> None:
        super().__init__(group, start, settings)
        self.learn_permutation(self.start["perm"], settings, self.start["perm"].ndim == 1)

    def element(self) -> Element:
        if self.learned is None:
            return self.start
        return {"perm": self.learned.hard()}

    def action(self) -> Action | None:
        if self.learned is None:
            return None
        m, _ = self.learned.matrix()
        return _dense(m)

    def describe(self) -> dict[str, Any]:
        return {"moved": self.learned.moved()} if self.learned is not None else {}


@parametrization("Heads", "Experts")
class HeadsParam(_PermutationLatent):
    """The head permutation (key/value groups) learned or frozen; each part's within-head
    elements by their own kind, batched over the key/value heads."""

    def __init__(self, group: Group, start: Element, settings: ParamSettings) -> None:
        super().__init__(group, start, settings)
        assert isinstance(group, Heads)
        self.heads = group
        self.parts = {name: parametrize(g, group.within(self.start, name), attrs.evolve(settings, permutations="frozen"))
                      for name, g in group.parts}
        self.learn_permutation(self.start["perm"], settings, group.kv > 1)

    def latents(self) -> list[torch.Tensor]:
        return [t for p in self.parts.values() for t in p.latents()] + super().latents()

    def _assemble(self, perm: torch.Tensor, parts: dict[str, Element]) -> Element:
        return self.heads._assemble(perm, self.start["qperm"], parts)

    def element(self) -> Element:
        return self._assemble(self.perm(), {n: p.element() for n, p in self.parts.items()})

    def project(self) -> Element:
        return self._assemble(self.perm().clone(), {n: p.project() for n, p in self.parts.items()})

    def action(self) -> Action | None:
        if self.learned is None:
            return None
        m, _ = self.learned.matrix()
        kv = self.heads.kv
        unpermuted = self._assemble(torch.arange(kv, device=m.device), {n: p.element() for n, p in self.parts.items()})
        group = self.heads

        def act(x: torch.Tensor, path: Path, variance: Variance) -> torch.Tensor:
            # new group j reads sum_i M[j, i] old group i, then the within-head maps (and the
            # order of query heads) act as in Heads.apply with the identity permutation
            mixed = (m.to(x.dtype) @ x.reshape(kv, -1)).reshape(x.shape)
            return group.apply(unpermuted, mixed, path, variance)

        return act

    def describe(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.learned is not None:
            out["moved"] = self.learned.moved()
        for name, p in self.parts.items():
            for k, v in p.describe().items():
                out[f"{name or 'within'}.{k}"] = v
        return out
