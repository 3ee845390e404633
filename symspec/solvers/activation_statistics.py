"""The activations' statistics: activation matching as weight matching on site moments.

Activation matching minimises, over one element per space,

    sum_s (1/n_s) sum_t || x_s^A(t) - rho_s(g) x_s^B(t) ||^2

over the activation sites ``s`` of the problem (:class:`~symspec.problem.Site`: the
features of a traced node, on which the spaces act as on one axis of a bound weight) and
the ``n_s`` tokens (or images) ``t`` of the data. Every solver reads only second moments
(``C = sum a b^T``, ``G = sum b b^T``, ``||a||^2``), so the features are never kept:

1. :class:`SiteMoments` accumulates, batch by batch, the joint second moment ``K`` of
   ``[x^A; x^B]`` (2f x 2f, float64) with the feature sums and the token count: memory is
   bounded by the statistics, whatever the number of batches;
2. :func:`activation_problem` factors each ``K = L L^T`` (an eigendecomposition, rank
   kept) and gives the site as a bound (features x rank) tensor ``L_A`` for A and ``L_B``
   for B: ``L_A L_B^T = sum x^A x^B^T`` and so on, so the weights' provider
   (:class:`~.weight_statistics.WeightStatistics`) and every per-kind solver, the
   descent and the execution strategy run unchanged on them (Procrustes for O/OC over
   every residual site at once, assignments for permutations and heads, least squares
   and Gauss-Newton for per-head GL with keys acting through the dual, closed forms for
   scalings and RoPE). A site whose spaces are all permutation groups is standardised
   first (``normalize="correlation"``: Git Re-Basin's correlation matching).

``weight+activation`` adds the weights' own terms to the same problem, the activation
terms scaled to ``mix`` times the weights' energy (:func:`combined_problem`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

import attrs
import torch

from ..problem import ParamBinding, Problem, Site
from .rounding import sqnorm

__all__ = ["ActivationMoments", "SiteMoments", "activation_problem", "combined_problem"]

NORMALIZE = ("correlation", "none")


@attrs.define
class SiteMoments:
    """Streaming moments of one site: ``gram`` = sum over tokens of ``z z^T`` with
    ``z = [x^A; x^B]`` (float64), ``total`` = sum of ``z``, ``count`` tokens."""

    size: int
    gram: torch.Tensor
    total: torch.Tensor
    count: int = 0

    @classmethod
    def zeros(cls, size: int, device: torch.device | str = "cpu") -> SiteMoments:
        return cls(size, torch.zeros(2 * size, 2 * size, dtype=torch.float64, device=device),
                   torch.zeros(2 * size, dtype=torch.float64, device=device))

    def update(self, xa: torch.Tensor, xb: torch.Tensor) -> None:
        """Add a batch: ``xa``, ``xb`` are (tokens, features) of A and B on the same inputs."""
        if xa.shape != xb.shape or xa.shape[-1] != self.size:
            raise ValueError(f"site features of shape {tuple(xa.shape)} and {tuple(xb.shape)}, expected (*, {self.size})")
        z = torch.cat([xa, xb], dim=1).to(self.gram.device, torch.float64)
        self.gram.addmm_(z.mT, z)
        self.total += z.sum(0)
        self.count += int(z.shape[0])

    def second_moment(self, normalize: bool) -> torch.Tensor:
        """The mean of ``z z^T``; with ``normalize``, the correlation matrix of ``z``
        (each feature centred and scaled to unit variance; constant features stay 0)."""
        m = self.gram / max(self.count, 1)
        if not normalize:
            return m
        mu = self.total / max(self.count, 1)
        cov = m - torch.outer(mu, mu)
        sd = cov.diagonal().clamp_min(0).sqrt()
        floor = float(sd.max()) * 1e-6 if sd.numel() else 0.0
        inv = torch.where(sd > floor, 1.0 / sd.clamp_min(floor if floor > 0 else 1.0), torch.zeros_like(sd))
        return cov * torch.outer(inv, inv)


@attrs.define
class ActivationMoments:
    """The moments of every site (site name -> :class:`SiteMoments`)."""

    sites: dict[str, Site]
    moments: dict[str, SiteMoments]
    batches: int = 0

    @classmethod
    def empty(cls, sites: Iterable[Site], device: torch.device | str = "cpu") -> ActivationMoments:
        sites = {s.name: s for s in sites}
        return cls(sites, {n: SiteMoments.zeros(s.size, device) for n, s in sites.items()})

    def update(self, fa: Mapping[str, torch.Tensor], fb: Mapping[str, torch.Tensor]) -> None:
        for name, m in self.moments.items():
            if name in fa and name in fb:
                m.update(fa[name], fb[name])
        self.batches += 1

    @property
    def bytes(self) -> int:
        return sum(m.gram.numel() * m.gram.element_size() + m.total.numel() * 8 for m in self.moments.values())

    @property
    def tokens(self) -> int:
        return max((m.count for m in self.moments.values()), default=0)

    def describe(self) -> dict[str, Any]:
        return {"sites": len(self.moments), "features": sum(m.size for m in self.moments.values()),
                "batches": self.batches, "tokens": self.tokens, "bytes": self.bytes}


def _permutation_only(problem: Problem, site: Site) -> bool:
    groups = [problem.spaces[s].group for s in site.spaces()]
    return all(g.permutation_subgroup() == g for g in groups)


def _roots(k: torch.Tensor, size: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``L_A``, ``L_B`` (size x rank) with ``[L_A; L_B][L_A; L_B]^T = k``: the eigenvectors
    of the PSD ``k`` scaled by the square roots of their eigenvalues, the numerically
    zero ones dropped (their directions carry no data)."""
    k = (k + k.mT) / 2
    vals, vecs = torch.linalg.eigh(k)
    keep = vals > vals.max().clamp_min(0) * (k.shape[0] * torch.finfo(torch.float64).eps)
    if not bool(keep.any()):
        keep[-1] = True
    root = vecs[:, keep] * vals[keep].clamp_min(0).sqrt()
    return root[:size].to(dtype).contiguous(), root[size:].to(dtype).contiguous()


def activation_problem(problem: Problem, moments: ActivationMoments, *, normalize: str = "correlation",
                       dtype: torch.dtype = torch.float32, scale: float = 1.0,
                       ) -> tuple[Problem, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """``problem`` with the sites as its bound tensors (see the module): the problem, A's
    and B's tensors, for :func:`~.weight.match_weights`. ``scale`` multiplies every
    site's objective."""
    if normalize not in NORMALIZE:
        raise ValueError(f"normalize must be one of {', '.join(NORMALIZE)}, got {normalize!r}")
    params: dict[str, ParamBinding] = {}
    sd_a: dict[str, torch.Tensor] = {}
    sd_b: dict[str, torch.Tensor] = {}
    for name, site in moments.sites.items():
        m = moments.moments[name]
        if m.count == 0 or not site.spaces() <= set(problem.spaces):
            continue
        corr = normalize == "correlation" and _permutation_only(problem, site)
        la, lb = _roots(m.second_moment(corr) * scale, site.size, dtype)
        binding = site.binding(la.shape[1])
        params[binding.name] = binding
        sd_a[binding.name], sd_b[binding.name] = la, lb
    return attrs.evolve(problem, params=params, ties=(), invariants=()), sd_a, sd_b


def combined_problem(problem: Problem, sd_a: Mapping[str, torch.Tensor], sd_b: Mapping[str, torch.Tensor],
                     moments: ActivationMoments, *, mix: float = 1.0, normalize: str = "correlation",
                     ) -> tuple[Problem, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Weight and activation terms in one problem: the activation terms scaled so that
    their energy (``||L_A||^2 + ||L_B||^2``) is ``mix`` times the weights' energy."""
    dtype = next((sd_a[p].dtype for p in problem.params), torch.float32)
    act, la, lb = activation_problem(problem, moments, normalize=normalize, dtype=dtype)
    w_energy = math.fsum(sqnorm(sd_a[p]) + sqnorm(sd_b[p]) for p in problem.params)
    a_energy = math.fsum(sqnorm(la[p]) + sqnorm(lb[p]) for p in act.params)
    s = math.sqrt(mix * w_energy / a_energy) if a_energy > 0 and w_energy > 0 else 1.0
    params = {**problem.params, **act.params}
    out_a = {**{p: sd_a[p] for p in problem.params}, **{p: t * s for p, t in la.items()}}
    out_b = {**{p: sd_b[p] for p in problem.params}, **{p: t * s for p, t in lb.items()}}
    return attrs.evolve(problem, params=params), out_a, out_b
