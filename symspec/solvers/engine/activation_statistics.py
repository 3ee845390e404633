"""The activations' statistics: activation matching as weight matching on site moments.

Activation matching minimises, over one element per space,

    sum_s (1/n_s) sum_t || x_s^A(t) - rho_s(g) x_s^B(t) ||^2

over the activation sites ``s`` of the problem (:class:`~symspec.problem.Site`: the
features of a traced node, on which the spaces act as on one axis of a bound weight) and
the ``n_s`` tokens (or images) ``t`` of the data. Every solver reads only second moments
(``C = sum a b^T``, ``G = sum b b^T``, ``||a||^2``), so the features are never kept:

1. :class:`SiteMoments` accumulates, batch by batch and per segment of the site's axis
   (only those diagonal blocks are read), ``C = sum x^A x^B^T`` and, where a factor of the
   segment is not orthogonal (GL heads, scalings), ``G = sum x^B x^B^T`` (a batch's
   products in float32, added into float64 totals), the feature sums and both models'
   sums of squares per feature: memory is bounded by the statistics, whatever the number
   of batches, and a permutation or orthogonal site never builds a Gram;
2. :func:`activation_terms` factors them, site by site (releasing each site's moments
   as it goes), into a bound (features x rank) tensor ``L_A`` for A and ``L_B`` for B
   with ``L_A L_B^T = C`` per block, ``L_B L_B^T = G`` (a Cholesky factor) or, without a Gram, ``diag(G)``,
   which is all that ``||rho(g) L_B||^2`` reads for an orthogonal ``rho``; the objective
   is the real one up to a constant ``offset`` (the part of A's energy the Gram-free
   tensors count twice; one more column of ``L_A`` fills what B cannot explain where
   there is none), so the weights' provider
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
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import attrs
import torch

from ...groups import Heads
from ...groups.continuous import DiagonalGroup
from ...problem import AxisBinding, Factor, ParamBinding, Problem, Segment, Site
from .descent import MatchEvent
from .rounding import sqnorm

__all__ = ["ActivationMoments", "ActivationTerms", "SiteMoments", "activation_problem", "activation_terms", "combined_problem",
           "mix_scale", "needs_gram", "readable_sites", "weights_energy"]

NORMALIZE = ("correlation", "none")


@attrs.define
class SiteMoments:
    """Streaming moments of one site, over tokens ``t``, per block of features (a segment
    of the site's axis: only the blocks on the diagonal are ever read, since every space
    acts on a segment as a whole): ``cross[k] = sum x^A_k x^B_k^T`` and, where the block's
    group is not orthogonal, ``gram[k] = sum x^B_k x^B_k^T`` (float64; None where the block
    needs no Gram: a permutation or orthogonal map keeps ``||rho(g) x||``, so only the
    cross term moves its objective); over all features, the sums of A and B and their
    sums of squares, and the token count. A's own Gram is never needed: it enters the
    objective only through its trace. ``index[k]``: the block's features (a slice, or
    their indices where a head-major layout interleaves them)."""

    size: int
    cross: list[torch.Tensor]
    gram: list[torch.Tensor | None]
    sum_a: torch.Tensor
    sum_b: torch.Tensor
    sq_a: torch.Tensor
    sq_b: torch.Tensor
    index: list[slice | torch.Tensor]
    count: int = 0
    #: float32 (cross, Gram) accumulators per block, added into the totals by :meth:`flush`
    _acc: list[tuple[torch.Tensor, torch.Tensor | None]] = attrs.field(factory=list, repr=False, eq=False)

    @classmethod
    def zeros(cls, size: int, device: torch.device | str = "cpu", *,
              blocks: Sequence[tuple[slice | torch.Tensor, bool]] | None = None) -> SiteMoments:
        """``blocks``: (features, whether it needs its Gram) per block; default one block
        of every feature, with its Gram."""
        blocks = [(slice(0, size), True)] if blocks is None else list(blocks)

        def z(*shape: int) -> torch.Tensor:
            return torch.zeros(*shape, dtype=torch.float64, device=device)

        def width(idx: slice | torch.Tensor) -> int:
            return idx.stop - idx.start if isinstance(idx, slice) else int(idx.numel())

        index = [idx if isinstance(idx, slice) else idx.to(device) for idx, _ in blocks]
        return cls(size, [z(width(i), width(i)) for i in index],
                   [z(width(i), width(i)) if gram else None for i, (_, gram) in zip(index, blocks)],
                   z(size), z(size), z(size), z(size), index)

    @classmethod
    def for_site(cls, problem: Problem, site: Site, device: torch.device | str = "cpu") -> SiteMoments:
        """The moments ``site`` needs: one block per segment of its axis, a Gram only where a
        factor acting on the segment is not orthogonal (:func:`needs_gram`)."""
        layout = site.axis.layout
        blocks = []
        for seg in site.axis.segments:
            if layout is None:
                idx: slice | torch.Tensor = slice(seg.start, seg.stop)
            else:
                idx = torch.tensor([layout.forward(i) for i in range(seg.start, seg.stop)], dtype=torch.long)
            blocks.append((idx, needs_gram(problem, seg)))
        return cls.zeros(site.size, device, blocks=blocks)

    def update(self, xa: torch.Tensor, xb: torch.Tensor) -> None:
        """Add a batch: ``xa``, ``xb`` are (tokens, features) of A and B on the same
        inputs. Float32 features' products are added into float32 accumulators in place
        (``addmm_``: no product allocated, no float64 pass per micro-batch), which
        :meth:`flush` adds into the float64 totals once per data batch (the precision
        of one float32 product over a batch's tokens, as before micro-batches; sums of
        squares cannot cancel); float64 features go straight into the totals."""
        if xa.shape != xb.shape or xa.shape[-1] != self.size:
            raise ValueError(f"site features of shape {tuple(xa.shape)} and {tuple(xb.shape)}, expected (*, {self.size})")
        dev = self.sum_a.device
        work = torch.float64 if xa.dtype == torch.float64 else torch.float32
        xa, xb = xa.to(dev, work), xb.to(dev, work)
        if work == torch.float32 and not self._acc:
            self._acc = [(torch.zeros_like(c, dtype=work), None if g is None else torch.zeros_like(g, dtype=work))
                         for c, g in zip(self.cross, self.gram)]
        for k, (idx, c, g) in enumerate(zip(self.index, self.cross, self.gram)):
            a, b = xa[:, idx], xb[:, idx]
            ac, ag = self._acc[k] if work == torch.float32 else (c, g)
            ac.addmm_(a.mT, b)
            if ag is not None:
                ag.addmm_(b.mT, b)
        self.sum_a.add_(xa.sum(0))
        self.sum_b.add_(xb.sum(0))
        self.sq_a.add_((xa * xa).sum(0))  # squares: nothing to cancel
        self.sq_b.add_((xb * xb).sum(0))
        self.count += int(xa.shape[0])

    def flush(self, release: bool = False) -> None:
        """Add the float32 accumulators into the float64 totals (and zero them; with
        ``release``, let them go: every batch is in)."""
        for (ac, ag), c, g in zip(self._acc, self.cross, self.gram):
            c.add_(ac)
            ac.zero_()
            if ag is not None and g is not None:
                g.add_(ag)
                ag.zero_()
        if release:
            self._acc = []

    @property
    def bytes(self) -> int:
        """The float64 totals' bytes (while batches arrive, float32 accumulators for
        the blocks and Grams hold half as much again)."""
        held = [*self.cross, *(g for g in self.gram if g is not None), self.sum_a, self.sum_b, self.sq_a, self.sq_b]
        return sum(t.numel() * t.element_size() for t in held)

    def means(self, normalize: bool) -> tuple[list[tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]], torch.Tensor]:
        """Per token, for each block ``(C, G or None, diag G)`` (``E[a b^T]``, ``E[b b^T]``)
        and, over the site, ``E[||a||^2]`` (a 0-d tensor); with ``normalize``, of the
        standardised features (each centred and scaled to unit variance; a constant
        feature is left out)."""
        self.flush(release=True)
        n = max(self.count, 1)
        out = []
        if not normalize:
            for idx, c, g in zip(self.index, self.cross, self.gram):
                out.append((c / n, None if g is None else g / n, self.sq_b[idx] / n))
            return out, self.sq_a.sum() / n
        mu_a, mu_b = self.sum_a / n, self.sum_b / n
        inv_a = _inverse_sd((self.sq_a / n - mu_a.square()).clamp_min(0).sqrt())
        for idx, c, g in zip(self.index, self.cross, self.gram):
            ma, mb = mu_a[idx], mu_b[idx]
            if g is None:
                var_b = (self.sq_b[idx] / n - mb.square()).clamp_min(0)
            else:
                g = g / n - torch.outer(mb, mb)
                var_b = g.diagonal().clamp_min(0)
            ib = _inverse_sd(var_b.sqrt())
            c = (c / n - torch.outer(ma, mb)) * torch.outer(inv_a[idx], ib)
            out.append((c, None if g is None else g * torch.outer(ib, ib), var_b * ib.square()))
        return out, (inv_a > 0).sum().to(torch.float64)


    def block_means(self, normalize: bool) -> list[tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor]]:
        """:meth:`means` per block, with A's energy per feature: ``(C, G or None, diag G,
        E[a_i^2])`` (standardised: 1 for every feature that varies, 0 for a constant one)."""
        blocks, _ = self.means(normalize)
        n = max(self.count, 1)
        if normalize:
            mu_a = self.sum_a / n
            var_a = (self.sq_a / n - mu_a.square()).clamp_min(0)
            per = (_inverse_sd(var_a.sqrt()) > 0).to(torch.float64)
        else:
            per = self.sq_a / n
        return [(c, g, d, per[idx]) for (c, g, d), idx in zip(blocks, self.index)]


def needs_gram(problem: Problem, segment: Segment) -> bool:
    """Whether a segment's objective needs B's Gram: not when every factor acting on it is
    a permutation group, acts orthogonally (``||rho(g) x|| = ||x||``: its objective is
    ``||a||^2 + ||b||^2 - 2 <rho(g), C>``, C alone) or is a diagonal scaling (D, Dpos:
    with permutations, ``rho(g)`` is a monomial matrix ``diag(s) P`` and
    ``||diag(s) P x||^2 = sum_i s_i^2 x_pi(i)^2`` reads only the Gram's diagonal, which
    the Gram-free factors keep; a gated MLP's up-projection scaling at 0.5B held 24
    float64 4864 x 4864 Grams for nothing); a GL or RoPE map does."""
    for f in segment.factors:
        group = problem.spaces[f.space].group if f.space in problem.spaces else None
        if group is None:
            return True
        if group.permutation_subgroup() == group or isinstance(group, DiagonalGroup):
            continue
        if f.variance == "abs" or not group.is_orthogonal(f.path):
            return True
    return False


def _inverse_sd(sd: torch.Tensor) -> torch.Tensor:
    """1/sd, and 0 for the features that are constant (sd below 1e-6 of the largest)."""
    floor = float(sd.max()) * 1e-6 if sd.numel() else 0.0
    return torch.where(sd > floor, 1.0 / sd.clamp_min(max(floor, torch.finfo(torch.float64).tiny)), torch.zeros_like(sd))


@attrs.define
class ActivationMoments:
    """The moments of every site (site name -> :class:`SiteMoments`). ``problem``: when
    given, each site keeps only the blocks and Grams its spaces read
    (:meth:`SiteMoments.for_site`); without it, one block with its Gram per site."""

    sites: dict[str, Site]
    moments: dict[str, SiteMoments]
    batches: int = 0

    @classmethod
    def empty(cls, sites: Iterable[Site], device: torch.device | str = "cpu",
              problem: Problem | None = None) -> ActivationMoments:
        sites = {s.name: s for s in sites}
        if problem is None:
            return cls(sites, {n: SiteMoments.zeros(s.size, device) for n, s in sites.items()})
        return cls(sites, {n: SiteMoments.for_site(problem, s, device) for n, s in sites.items()})

    def update(self, fa: Mapping[str, torch.Tensor], fb: Mapping[str, torch.Tensor]) -> None:
        for name, m in self.moments.items():
            if name in fa and name in fb:
                m.update(fa[name], fb[name])
        self.end_batch()

    def update_site(self, name: str, xa: torch.Tensor, xb: torch.Tensor) -> None:
        """Add one site's features of a batch (:meth:`end_batch` once the batch is done)."""
        if name in self.moments:
            self.moments[name].update(xa, xb)

    def end_batch(self) -> None:
        """A data batch is in: its float32 products go into the float64 totals."""
        for m in self.moments.values():
            m.flush()
        self.batches += 1

    def end_batches(self) -> None:
        """Every batch is in: the float32 accumulators are let go."""
        for m in self.moments.values():
            m.flush(release=True)

    @property
    def bytes(self) -> int:
        return sum(m.bytes for m in self.moments.values())

    @property
    def tokens(self) -> int:
        return max((m.count for m in self.moments.values()), default=0)

    def describe(self) -> dict[str, Any]:
        grams = sum(1 for m in self.moments.values() for g in m.gram if g is not None)
        blocks = sum(len(m.gram) for m in self.moments.values())
        return {"sites": len(self.moments), "features": sum(m.size for m in self.moments.values()),
                "batches": self.batches, "tokens": self.tokens, "bytes": self.bytes,
                "blocks": blocks, "gram_blocks": grams}


def _permutation_only(problem: Problem, site: Site) -> bool:
    groups = [problem.spaces[s].group for s in site.spaces()]
    return all(g.permutation_subgroup() == g for g in groups)


def _gram_roots(c: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``L_A``, ``L_B`` (n x rank) with ``L_A L_B^T = c`` and ``L_B L_B^T = g``: ``L_B`` the
    Cholesky factor of ``g`` and ``L_A = c L_B^-T`` (a Cholesky is 10 to 30 times faster
    than an eigendecomposition here). A ``g`` that is singular to its precision (a
    centred residual leaves queries one direction short; float32 batch products leave
    its null directions at +-1e-7 of its largest entry) gets the least multiple of the
    identity that makes it definite, ``n eps`` of its largest diagonal times a power of
    10: the size of its own rounding, and the rows of ``c``, which lie in its range,
    gain nothing in the added directions. Should none do,
    the eigenvectors of ``g`` scaled by the square roots of their eigenvalues, the
    numerically zero ones dropped, and ``L_A = c V diag(lambda^-1/2)``. Either way
    ``||L_A||^2 = tr(c g^+ c^T)``, A's energy that B's features explain."""
    g = (g + g.mT) / 2
    n, eps = g.shape[0], torch.finfo(torch.float64).eps
    top = float(g.diagonal().max().clamp_min(0))
    eye = torch.eye(n, dtype=g.dtype, device=g.device)
    for k in range(-1, 9):  # the least jitter (a power of 10 of n eps) that makes g definite
        jitter = 0.0 if k < 0 else top * n * eps * 10.0**k
        low, info = torch.linalg.cholesky_ex(g + jitter * eye if jitter else g)
        if int(info) == 0 and bool((low.diagonal().square() > top * n * eps).all()):
            return torch.linalg.solve_triangular(low.mT, c, upper=True, left=False), low
    vals, vecs = torch.linalg.eigh(g)
    keep = vals > vals.max().clamp_min(0) * (n * eps)
    if not bool(keep.any()):
        keep[-1] = True
    root = vals[keep].clamp_min(torch.finfo(torch.float64).tiny).sqrt()
    vecs = vecs[:, keep]
    return (c @ vecs) / root, vecs * root


def _diag_roots(c: torch.Tensor, gdiag: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Without the Gram (a permutation or orthogonal block): ``L_B = diag(G)^1/2`` and
    ``L_A = c diag(G)^-1/2`` (its features without variance dropped): ``L_A L_B^T = c``,
    and each row of ``L_B`` has B's energy of that feature (``||L_A,k - L_B,j||^2`` is
    ``E||x_A,k - x_B,j||^2`` up to a constant per k). ``||L_A||^2`` is no bound on A's
    energy here (:func:`_site_roots` accounts for the difference)."""
    keep = gdiag > gdiag.max().clamp_min(0) * torch.finfo(torch.float64).eps if gdiag.numel() else gdiag > 0
    if not bool(keep.any()):
        keep = torch.zeros_like(keep)
        keep[-1] = True
    root = gdiag[keep].clamp_min(torch.finfo(torch.float64).tiny).sqrt()
    lb = torch.zeros(gdiag.shape[0], root.shape[0], dtype=c.dtype, device=c.device)
    lb[keep.nonzero().squeeze(1), torch.arange(root.shape[0], device=c.device)] = root
    return c[:, keep] / root, lb


@attrs.frozen
class SiteRoots:
    """One site factored: ``la``, ``lb`` (features x columns, block-diagonal over the
    site's blocks), ``offset``: how much ``||L_A||^2 + ||L_B||^2`` exceeds A's and B's real
    energy (0 where one more column of ``L_A``, facing zeros in ``L_B``, fills what of A
    the features of B do not explain), ``energy``: that real energy, and ``b_trace``: the
    trace of B's Gram."""

    la: torch.Tensor
    lb: torch.Tensor
    offset: float
    energy: float
    b_trace: float


def _site_roots(m: SiteMoments, normalize: bool, scale: float, dtype: torch.dtype) -> SiteRoots:
    """The bound tensors of one site (see :class:`SiteRoots`)."""
    blocks, sq_a = m.means(normalize)
    sq_a = float(sq_a) * scale
    parts = []
    b_trace = 0.0
    for idx, (c, g, gdiag) in zip(m.index, blocks):
        la, lb = _diag_roots(c * scale, gdiag * scale) if g is None else _gram_roots(c * scale, g * scale)
        parts.append((idx, la, lb))
        b_trace += float(gdiag.sum()) * scale
    cols = sum(p[1].shape[1] for p in parts)
    dev = parts[0][1].device
    la_all = torch.zeros(m.size, cols + 1, dtype=torch.float64, device=dev)
    lb_all = torch.zeros(m.size, cols + 1, dtype=torch.float64, device=dev)
    at = 0
    for idx, la, lb in parts:
        width = la.shape[1]
        la_all[idx, at : at + width] = la
        lb_all[idx, at : at + width] = lb
        at += width
    rest = sq_a - float(la_all.square().sum())
    la_all[0, cols] = math.sqrt(max(rest, 0.0))
    # what ||L_B||^2 misses of B's energy (none in exact arithmetic: both are traces of G)
    offset = max(-rest, 0.0) + float(lb_all.square().sum()) - b_trace
    return SiteRoots(la_all.to(dtype).contiguous(), lb_all.to(dtype).contiguous(), offset, sq_a + b_trace, b_trace)


@attrs.frozen
class ActivationTerms:
    """The sites as bound tensors: ``problem`` (the sites as its parameters), A's and B's
    tensors, and ``offset``: how much the objective that the solvers see exceeds the
    real one (a constant whatever the elements: the part of A's energy that the Gram-free
    sites' tensors count twice; subtract it from the values reported). ``energy``: the
    sites' real energy (``E||a||^2 + E||b||^2``, summed)."""

    problem: Problem
    sd_a: dict[str, torch.Tensor]
    sd_b: dict[str, torch.Tensor]
    offset: float = 0.0
    energy: float = 0.0


def readable_sites(problem: Problem, moments: ActivationMoments, normalize: str,
                   progress: Callable[[Any], None] | None = None) -> Iterator[tuple[str, Site, SiteMoments, bool]]:
    """The sites with moments to read, each as (name, site, its moments, whether to
    standardise it: ``normalize`` is ``correlation`` and every space of the site is a
    permutation group); a ``MatchEvent("factor", ...)`` to ``progress`` before each site
    (``space``: its name; ``done`` of ``total`` sites). Sites without tokens, or acted on
    by a space the problem has not, are left out."""
    if normalize not in NORMALIZE:
        raise ValueError(f"normalize must be one of {', '.join(NORMALIZE)}, got {normalize!r}")
    sites = list(moments.sites.items())
    for i, (name, site) in enumerate(sites):
        if progress is not None:
            progress(MatchEvent("factor", 0, 0, space=name, done=i, total=len(sites)))
        m = moments.moments.get(name)
        if m is None or m.count == 0 or not site.spaces() <= set(problem.spaces):
            continue
        yield name, site, m, normalize == "correlation" and _permutation_only(problem, site)


def activation_terms(problem: Problem, moments: ActivationMoments, *, normalize: str = "correlation",
                     dtype: torch.dtype = torch.float32, scale: float = 1.0, ridge: float = 0.0,
                     release: bool = False, progress: Callable[[Any], None] | None = None) -> ActivationTerms:
    """``problem`` with the sites as its bound tensors (see the module), for
    :func:`~.weight.match_weights`. ``scale`` multiplies every site's objective; ``ridge``
    adds the per-head ridge of :func:`head_ridges`; ``release``: each site's moments are
    dropped from ``moments`` as soon as it is factored (the float64 moments and the
    factors are never all held at once). ``progress``: a ``MatchEvent("factor", ...)``
    before each site (``space``: its name; ``done`` of ``total`` sites factored)."""
    params: dict[str, ParamBinding] = {}
    sd_a: dict[str, torch.Tensor] = {}
    sd_b: dict[str, torch.Tensor] = {}
    energy: dict[str, list[float]] = {}
    offset = total = 0.0
    for name, site, m, corr in readable_sites(problem, moments, normalize, progress):
        roots = _site_roots(m, corr, scale, dtype)
        if release:
            del moments.moments[name], m
        binding = site.binding(roots.la.shape[1])
        params[binding.name] = binding
        sd_a[binding.name], sd_b[binding.name] = roots.la, roots.lb
        offset += roots.offset
        total += roots.energy
        for space in site.spaces():  # B's mean energy per feature, for the ridge's scale
            energy.setdefault(space, []).append(roots.b_trace / max(site.size, 1))
    if ridge > 0:
        for binding, t in head_ridges(problem, energy, ridge, dtype):
            params[binding.name] = binding
            sd_a[binding.name], sd_b[binding.name] = t, t.clone()
    return ActivationTerms(attrs.evolve(problem, params=params, ties=(), invariants=()), sd_a, sd_b, offset, total)


def activation_problem(problem: Problem, moments: ActivationMoments, *, normalize: str = "correlation",
                       dtype: torch.dtype = torch.float32, scale: float = 1.0, ridge: float = 0.0,
                       ) -> tuple[Problem, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """:func:`activation_terms` as (problem, A's tensors, B's tensors)."""
    t = activation_terms(problem, moments, normalize=normalize, dtype=dtype, scale=scale, ridge=ridge)
    return t.problem, t.sd_a, t.sd_b


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


def weights_energy(problem: Problem, sd_a: Mapping[str, torch.Tensor], sd_b: Mapping[str, torch.Tensor]) -> float:
    """The weights' energy, ``sum ||A_P||^2 + ||B_P||^2`` over the bound parameters."""
    return math.fsum(sqnorm(sd_a[p]) + sqnorm(sd_b[p]) for p in problem.params)


def mix_scale(mix: float, weights_energy: float, sites_energy: float) -> float:
    """The factor on the activation terms that makes their real energy ``mix`` times the
    weights' (1 where either is zero)."""
    if sites_energy > 0 and weights_energy > 0:
        return math.sqrt(mix * weights_energy / sites_energy)
    return 1.0


def combined_problem(problem: Problem, sd_a: Mapping[str, torch.Tensor], sd_b: Mapping[str, torch.Tensor],
                     moments: ActivationMoments, *, mix: float = 1.0, normalize: str = "correlation",
                     release: bool = False, progress: Callable[[Any], None] | None = None) -> ActivationTerms:
    """Weight and activation terms in one problem: the activation terms scaled so that
    their real energy (``E||a||^2 + E||b||^2`` over the sites) is ``mix`` times the
    weights' energy; ``offset`` scaled with them."""
    dtype = next((sd_a[p].dtype for p in problem.params), torch.float32)
    act = activation_terms(problem, moments, normalize=normalize, dtype=dtype, release=release, progress=progress)
    s = mix_scale(mix, weights_energy(problem, sd_a, sd_b), act.energy)
    params = {**problem.params, **act.problem.params}
    out_a = {**{p: sd_a[p] for p in problem.params}, **{p: t * s for p, t in act.sd_a.items()}}
    out_b = {**{p: sd_b[p] for p in problem.params}, **{p: t * s for p, t in act.sd_b.items()}}
    return ActivationTerms(attrs.evolve(problem, params=params), out_a, out_b, act.offset * s * s, act.energy * s * s)
