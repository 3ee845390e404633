"""Activation sites read as statistics (issue 30: :mod:`symspec.solvers.engine.site_statistics`):
each site keeps its cross moments, a Gram only where a factor is not orthogonal, and A's
energy per feature; no tensor per site is built and nothing is multiplied out per
round. The objective it computes must be the real one -- the mean distance of the
recorded features, A's against B's moved by the elements -- at any elements (not only
the identity), merged sites must give the sum of their objectives, and alignment on
the statistics must follow the factored tensors' descent (the first design) to
rounding."""

from __future__ import annotations

import copy

import pytest
import torch

import symspec
import symspec.alignment.moments as mo
from symspec.alignment.moments import collect_moments, collect_site_stats
from symspec.errors import SymspecInputError
from symspec.problem import Factor, Segment, Site
from symspec.solvers.engine.base import SolveContext, Timer
from symspec.solvers.engine.site_statistics import (
    SiteStatistics,
    merge_site_stats,
    site_statistics_supported,
    site_stats,
)
from tests.test_activation import _moved
from tests.test_activation_streamed import _pair, _recorded

FAMILIES = ["nanogpt", "gpt_neox", "llama"]


def _ctx() -> SolveContext:
    return SolveContext(device=torch.device("cpu"), dtype=torch.float64, timer=Timer(), max_iter=5)


def _sampled(problem: symspec.Problem, seed: int) -> dict[str, dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return {s: {k: v.double() if v.is_floating_point() else v for k, v in si.group.sample(gen).items()}
            for s, si in problem.spaces.items()}


@pytest.mark.parametrize("name", FAMILIES)
def test_the_site_objective_is_the_distance_of_the_recorded_features(name: str) -> None:
    canon, bound, sa, sb, data = _pair(name)
    problem = bound.problem
    moments = collect_moments(canon, problem, sa, sb, data)
    stats, _ = site_stats(problem, moments, normalize="none", dtype=torch.float64)
    fa, fb = _recorded(canon, bound, sa, data), _recorded(canon, bound, sb, data)
    sites = {s.name: s for s in moments.sites.values()}
    for seed in (0, 1):
        g = _sampled(problem, seed)
        provider = SiteStatistics(problem, stats, _ctx(), g)
        for s in stats:
            xa, xb = fa[s.name], fb[s.name]
            real = float((xa - _moved(sites[s.name], bound, xb, g)).square().sum()) / xa.shape[0]
            got = provider.objective()[f"site:{s.name}"]
            assert got.value == pytest.approx(real, rel=1e-9, abs=1e-9), s.name
            assert got.level < 1e-9 * max(real, 1.0)
        # negative: the same statistics read at other elements are another objective
        other = SiteStatistics(problem, stats, _ctx(), _sampled(problem, seed + 10))
        moved = [s.name for s in stats if other.objective()[f"site:{s.name}"].value
                 != pytest.approx(provider.objective()[f"site:{s.name}"].value, rel=1e-6)]
        assert len(moved) > len(stats) // 2


def test_merged_sites_give_the_sum_of_their_objectives() -> None:
    canon, bound, sa, sb, data = _pair("llama")
    problem = bound.problem
    stats, _ = site_stats(problem, collect_moments(canon, problem, sa, sb, data), normalize="none", dtype=torch.float64)
    g = _sampled(problem, 2)
    alone = sum(v.value for v in SiteStatistics(problem, stats, _ctx(), g).objective().values())
    merged = merge_site_stats(copy.deepcopy(stats))
    assert len(merged) < len(stats)  # the residual's reads and writes, the MLP's up and down sites
    assert sorted(n for m in merged for n in m.names) == sorted(s.name for s in stats)
    together = sum(v.value for v in SiteStatistics(problem, merged, _ctx(), g).objective().values())
    assert together == pytest.approx(alone, rel=1e-10)
    # negative: a site merged into one acted on otherwise would change the objective
    resid = next(s for s in stats if s.structure() == stats[0].structure())
    mlp = next(s for s in stats if s.structure() != resid.structure() and s.blocks[0].cross.shape == resid.blocks[0].cross.shape)
    wrong = copy.deepcopy(resid)
    wrong.blocks[0].segment = mlp.blocks[0].segment
    assert sum(v.value for v in SiteStatistics(problem, [wrong], _ctx(), g).objective().values()) != pytest.approx(
        SiteStatistics(problem, [resid], _ctx(), g).objective()[f"site:{resid.name}"].value, rel=1e-6)


@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize("method", ["activation", "weight+activation"])
def test_alignment_on_the_statistics_follows_the_factored_descent(name: str, method: str,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    from symspec.alignment import ActivationOptions

    canon, _, _, sb, data = _pair(name)
    b = copy.deepcopy(canon)
    b.load_state_dict(sb)
    runs = {}
    for form in ("factored", "sites"):
        with monkeypatch.context() as m:
            if form == "factored":  # what a site whose factors the statistics cannot read gets
                m.setattr(mo, "site_statistics_supported", lambda *args: False)
            runs[form] = symspec.align(canon, b, name, method=method, data=data, rounds=3, tol=0.0,
                                       options=ActivationOptions(ridge=1e-3))
        assert runs[form].info["form"] == form
    assert runs["sites"].history == pytest.approx(runs["factored"].history, rel=1e-6)
    assert runs["sites"].history[-1] < runs["sites"].history[0]  # it descends


def test_sites_are_read_as_statistics_only_where_the_factors_allow_it() -> None:
    canon, bound, sa, sb, data = _pair("llama", batches=1)
    problem = bound.problem
    moments = collect_moments(canon, problem, sa, sb, data)
    assert site_statistics_supported(problem, moments.sites.values())
    perm = next(s for s in problem.spaces if s.startswith("mlp"))
    scale = next(s for s in problem.spaces if s.startswith("up"))
    n = 8

    def site(*spaces: str) -> Site:
        from symspec.problem import AxisBinding

        return Site("x", "x", "pre", "p", AxisBinding(0, (Segment(0, n, tuple(Factor(s) for s in spaces)),)))

    assert site_statistics_supported(problem, [site(perm, scale)])  # the joint pair
    assert site_statistics_supported(problem, [site("resid")])
    # an orthogonal map acting after a scaling: A's energies per feature do not follow it
    assert not site_statistics_supported(problem, [site("resid", scale)])
    assert not site_statistics_supported(problem, [site("no such space")])


def _collect(name: str, available: int | None = None, batches: int = 3) -> mo.SiteCollection:
    canon, bound, sa, sb, data = _pair(name, batches=batches)
    out = collect_site_stats(canon, bound.problem, sa, sb, data, dtype=torch.float64, available=available)
    assert out is not None
    return out


def _staged(name: str) -> tuple[mo.SiteCollection, mo.SiteCollection, int]:
    """One pass; the same in stages, with the least memory (in steps) that runs it; that memory."""
    one = _collect(name)
    for factor in (1.5, 2, 2.5, 3, 4, 6, 8, 12):
        budget = int(one.described["bytes"] * factor)
        try:
            many = _collect(name, available=budget)
        except SymspecInputError as e:
            assert "need about" in str(e) and "more than the" in str(e)
            continue
        if many.described["stages"] > 1:
            return one, many, budget
    raise AssertionError("no budget split the pass")


@pytest.mark.parametrize("name", FAMILIES)
def test_statistics_collected_in_stages_equal_those_of_one_pass(name: str) -> None:
    one, many, _ = _staged(name)
    assert one.described["stages"] == 1 and many.described["stages"] > 1
    assert many.described["stage_bytes"] < one.described["stage_bytes"]  # what one stage holds at once
    assert [s.name for s in many.stats] == [s.name for s in one.stats]
    for x, y in zip(one.stats, many.stats):
        assert x.names == y.names
        for bx, by in zip(x.blocks, y.blocks):  # the same products in the same order: bit for bit
            assert torch.equal(bx.cross, by.cross) and torch.equal(bx.asq, by.asq) and torch.equal(bx.gdiag, by.gdiag)
            assert (bx.gram is None) == (by.gram is None)
            if bx.gram is not None:
                assert torch.equal(bx.gram, by.gram)
    assert one.energy == many.energy


def test_a_pass_whose_largest_site_does_not_fit_is_refused_in_one_line() -> None:
    with pytest.raises(SymspecInputError, match=r"need about .* GB .*largest.*more than the .* GB this machine has free"):
        _collect("llama", available=1000)
    assert _collect("llama", available=None).described["stages"] == 1  # unknown memory: one pass


def test_alignment_in_stages_gives_the_one_pass_result(monkeypatch: pytest.MonkeyPatch) -> None:
    from symspec.alignment import ActivationOptions

    _, _, budget = _staged("llama")
    canon, _, _, sb, data = _pair("llama")
    b = copy.deepcopy(canon)
    b.load_state_dict(sb)
    results = []
    for free in (None, budget):
        with monkeypatch.context() as m:
            if free is not None:
                m.setattr(mo, "available_memory", lambda: budget)
            results.append(symspec.align(canon, b, "llama", method="weight+activation", data=data, rounds=3,
                                         options=ActivationOptions()))
    whole, staged = results
    assert staged.info["statistics"]["stages"] > 1 and whole.info["statistics"]["stages"] == 1
    assert staged.history == whole.history
    for space, e in whole.elements.items():
        for k, v in e.items():
            assert torch.equal(staged.elements[space][k], v), (space, k)


def test_weight_plus_activation_given_b_works_on_b_itself() -> None:
    """With B given up (``keep_canonical_b=False``, what ``symspec match`` does), B's
    canonical tensors become the weights' working copy, as in weight matching, instead of
    a copy beside them; the result is the same (B moved round by round rather than once at
    the end: to rounding, as in weight matching)."""
    canon, _, _, sb, data = _pair("llama")
    b = copy.deepcopy(canon)
    b.load_state_dict(sb)
    kept = symspec.align(canon, b, "llama", method="weight+activation", data=data, rounds=3)
    given = symspec.align(canon, b, "llama", method="weight+activation", data=data, rounds=3, keep_canonical_b=False)
    assert given.canonical_b is None and kept.canonical_b is not None
    assert given.history == pytest.approx(kept.history, rel=1e-12)
    for k, v in kept.aligned_b.items():
        torch.testing.assert_close(given.aligned_b[k], v, rtol=1e-7, atol=1e-8, msg=k)
    assert torch.equal(b.state_dict()[next(iter(sb))], sb[next(iter(sb))])  # the caller's B is untouched
