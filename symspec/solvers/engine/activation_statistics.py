"""The activations' statistics: activation matching as weight matching on site moments.

Activation matching minimises, over one element per space,

    sum_s (1/n_s) sum_t || x_s^A(t) - rho_s(g) x_s^B(t) ||^2

over the activation sites ``s`` of the problem (:class:`~symspec.problem.Site`: the
features of a traced node, on which the spaces act as on one axis of a bound weight) and
the ``n_s`` tokens (or images) ``t`` of the data. Every solver reads only second moments
(``C = sum a b^T``, ``G = sum b b^T``, ``||a||^2``), so the features are never kept:

1. :class:`SiteMoments` accumulates, batch by batch, ``C = sum x^A x^B^T`` and
   ``G = sum x^B x^B^T`` (f x f, float64), the feature sums and A's sums of squares:
   memory is bounded by the statistics, whatever the number of batches;
2. :func:`activation_problem` factors them (an eigendecomposition of ``G``, rank kept)
   into a bound (features x rank) tensor ``L_A`` for A and ``L_B`` for B with
   ``L_A L_B^T = C``, ``L_B L_B^T = G`` and ``||L_A||^2 = sum ||x^A||^2``, so the weights' provider
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

from ...groups import Heads
from ...problem import AxisBinding, Factor, ParamBinding, Problem, Segment, Site
from .rounding import sqnorm

__all__ = ["ActivationMoments", "SiteMoments", "activation_problem", "combined_problem"]

NORMALIZE = ("correlation", "none")


@attrs.define
class SiteMoments:
    """Streaming moments of one site, over tokens ``t``: ``cross = sum x^A x^B^T`` and
    ``gram = sum x^B x^B^T`` (f x f, float64), the feature sums of A and B, A's sums of
    squares per feature, and the token count. A's own Gram is not needed: it enters the
    objective only through its trace."""

    size: int
    cross: torch.Tensor
    gram: torch.Tensor
    sum_a: torch.Tensor
    sum_b: torch.Tensor
    sq_a: torch.Tensor
    count: int = 0

    @classmethod
    def zeros(cls, size: int, device: torch.device | str = "cpu") -> SiteMoments:
        def z(*shape: int) -> torch.Tensor:
            return torch.zeros(*shape, dtype=torch.float64, device=device)

        return cls(size, z(size, size), z(size, size), z(size), z(size), z(size))

    def update(self, xa: torch.Tensor, xb: torch.Tensor) -> None:
        """Add a batch: ``xa``, ``xb`` are (tokens, features) of A and B on the same
        inputs. A batch's products and sums are computed in the features' own precision
        (float32 for float32 features: one batch's sums of squares cannot cancel) and
        accumulated across batches in float64."""
        if xa.shape != xb.shape or xa.shape[-1] != self.size:
            raise ValueError(f"site features of shape {tuple(xa.shape)} and {tuple(xb.shape)}, expected (*, {self.size})")
        dev = self.cross.device
        work = torch.float64 if xa.dtype == torch.float64 else torch.float32
        xa, xb = xa.to(dev, work), xb.to(dev, work)
        self.cross += (xa.mT @ xb).double()
        self.gram += (xb.mT @ xb).double()
        self.sum_a += xa.sum(0).double()
        self.sum_b += xb.sum(0).double()
        self.sq_a += (xa * xa).sum(0).double()  # squares: nothing to cancel
        self.count += int(xa.shape[0])

    @property
    def bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.cross, self.gram, self.sum_a, self.sum_b, self.sq_a))

    def means(self, normalize: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Per token: ``C = E[a b^T]``, ``G = E[b b^T]`` and ``E[||a||^2]`` (a 0-d tensor);
        with ``normalize``, of the standardised features (each centred and scaled to unit
        variance; a constant feature is left out)."""
        n = max(self.count, 1)
        c, g, sa = self.cross / n, self.gram / n, self.sq_a.sum() / n
        if not normalize:
            return c, g, sa
        mu_a, mu_b = self.sum_a / n, self.sum_b / n
        c = c - torch.outer(mu_a, mu_b)
        g = g - torch.outer(mu_b, mu_b)
        inv_a = _inverse_sd((self.sq_a / n - mu_a.square()).clamp_min(0).sqrt())
        inv_b = _inverse_sd(g.diagonal().clamp_min(0).sqrt())
        return c * torch.outer(inv_a, inv_b), g * torch.outer(inv_b, inv_b), (inv_a > 0).sum().to(torch.float64)


def _inverse_sd(sd: torch.Tensor) -> torch.Tensor:
    """1/sd, and 0 for the features that are constant (sd below 1e-6 of the largest)."""
    floor = float(sd.max()) * 1e-6 if sd.numel() else 0.0
    return torch.where(sd > floor, 1.0 / sd.clamp_min(max(floor, torch.finfo(torch.float64).tiny)), torch.zeros_like(sd))


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
        return sum(m.bytes for m in self.moments.values())

    @property
    def tokens(self) -> int:
        return max((m.count for m in self.moments.values()), default=0)

    def describe(self) -> dict[str, Any]:
        return {"sites": len(self.moments), "features": sum(m.size for m in self.moments.values()),
                "batches": self.batches, "tokens": self.tokens, "bytes": self.bytes}


def _permutation_only(problem: Problem, site: Site) -> bool:
    groups = [problem.spaces[s].group for s in site.spaces()]
    return all(g.permutation_subgroup() == g for g in groups)


def _roots(c: torch.Tensor, g: torch.Tensor, sq_a: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``L_A``, ``L_B`` (f x rank + 1) with ``L_A L_B^T = c``, ``L_B L_B^T = g`` and
    ``||L_A||^2 = sq_a``: ``L_B`` the eigenvectors of ``g`` scaled by the square roots of
    their eigenvalues (the numerically zero ones dropped: no data there), ``L_A = c V
    diag(lambda^-1/2)`` (the rows of ``c`` lie in the range of ``g``), and one more column
    of ``L_A``, facing zeros in ``L_B``, carrying what of A the features of B cannot
    explain (so the objective is the real one, not up to a constant)."""
    g = (g + g.mT) / 2
    vals, vecs = torch.linalg.eigh(g)
    keep = vals > vals.max().clamp_min(0) * (g.shape[0] * torch.finfo(torch.float64).eps)
    if not bool(keep.any()):
        keep[-1] = True
    root = vals[keep].clamp_min(torch.finfo(torch.float64).tiny).sqrt()
    vecs = vecs[:, keep]
    lb = vecs * root
    la = (c @ vecs) / root
    rest = (sq_a - la.square().sum()).clamp_min(0).sqrt()
    extra = torch.zeros(la.shape[0], 1, dtype=la.dtype, device=la.device)
    extra[0, 0] = rest
    la = torch.cat([la, extra], 1)
    lb = torch.cat([lb, torch.zeros_like(extra)], 1)
    return la.to(dtype).contiguous(), lb.to(dtype).contiguous()


def activation_problem(problem: Problem, moments: ActivationMoments, *, normalize: str = "correlation",
                       dtype: torch.dtype = torch.float32, scale: float = 1.0, ridge: float = 0.0,
                       ) -> tuple[Problem, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """``problem`` with the sites as its bound tensors (see the module): the problem, A's
    and B's tensors, for :func:`~.weight.match_weights`. ``scale`` multiplies every
    site's objective; ``ridge`` adds the per-head ridge of :func:`head_ridges`."""
    if normalize not in NORMALIZE:
        raise ValueError(f"normalize must be one of {', '.join(NORMALIZE)}, got {normalize!r}")
    params: dict[str, ParamBinding] = {}
    sd_a: dict[str, torch.Tensor] = {}
    sd_b: dict[str, torch.Tensor] = {}
    energy: dict[str, list[float]] = {}
    for name, site in moments.sites.items():
        m = moments.moments[name]
        if m.count == 0 or not site.spaces() <= set(problem.spaces):
            continue
        corr = normalize == "correlation" and _permutation_only(problem, site)
        c, g, sq_a = m.means(corr)
        la, lb = _roots(c * scale, g * scale, sq_a * scale, dtype)
        binding = site.binding(la.shape[1])
        params[binding.name] = binding
        sd_a[binding.name], sd_b[binding.name] = la, lb
        for space in site.spaces():  # B's mean energy per feature, for the ridge's scale
            energy.setdefault(space, []).append(float(g.diagonal().sum()) * scale / max(site.size, 1))
    if ridge > 0:
        for binding, t in head_ridges(problem, energy, ridge, dtype):
            params[binding.name] = binding
            sd_a[binding.name], sd_b[binding.name] = t, t.clone()
    return attrs.evolve(problem, params=params, ties=(), invariants=()), sd_a, sd_b


def head_ridges(problem: Problem, energy: Mapping[str, list[float]], ridge: float,
                dtype: torch.dtype) -> list[tuple[ParamBinding, torch.Tensor]]:
    """A ridge toward the identity on the per-head maps that are not orthogonal (GL, RoPE,
    scalings), for activation matching: without one, directions in which B's features
    barely vary are stretched freely (the function is kept, the interpolation is not;
    bench/results/activation_attention.json). For every such part, two bound tensors, one acting as
    the map (``co``) and one as its inverse transpose (``contra``), equal in A and B:
    ``c [I; I; ...; I]`` (one identity block per key/value head, in shared columns), so
    that the objective gains ``c^2 sum_j (||I - g_j||^2 + ||I - g_j^-T||^2)``, which is the
    same for every head permutation. ``c^2 = ridge x`` the mean energy per feature of the
    space's sites in B."""
    out = []
    for space, si in problem.spaces.items():
        group = si.group
        if not isinstance(group, Heads) or space not in energy:
            continue
        level = ridge * sum(energy[space]) / len(energy[space])
        if not level > 0:
            continue
        for part, g in group.parts:
            if g.is_orthogonal() or g.is_trivial():
                continue
            path = (part, "kv") if part else ("kv",)
            dh = g.n
            block = torch.eye(dh, dtype=torch.float64).repeat(group.kv, 1) * math.sqrt(level)
            for variance in ("co", "contra"):
                axis = AxisBinding(0, (Segment(0, group.kv * dh, (Factor(space, path, variance),)),))
                name = f"ridge:{space}:{part or 'within'}:{variance}"
                out.append((ParamBinding(name, (group.kv * dh, dh), (axis,)), block.to(dtype)))
    return out


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
