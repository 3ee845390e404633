"""Streamed activation statistics (issue 30): both models run on the same batches, B's
features added to the moments site by site as B computes them, per segment of a site's
axis, a Gram only where a factor acting on the segment is not orthogonal, each site's
moments released as soon as it is factored. They must equal the statistics of the
recorded activations themselves, and give the result of the unstreamed statistics (one
block with its Gram per site, as before) up to float64 rounding."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from symspec.alignment.moments import collect_moments
from symspec.graph import SiteRecorder, read_sites
from symspec.solvers import match_weights
from symspec.solvers.engine.activation_statistics import (
    ActivationMoments,
    activation_terms,
    needs_gram,
)
from tests.test_activation import _family, _fresh

#: gpt_neox stores its fused QKV head-major: a segment's features are interleaved (an index, not a slice)
FAMILIES = ["nanogpt", "gpt_neox", "llama"]


def _pair(name: str, batches: int = 3) -> tuple[torch.nn.Module, Any, dict[str, torch.Tensor], dict[str, torch.Tensor], Any]:
    canon, inputs, bound = _family(name)
    torch.manual_seed(5)
    sa = canon.state_dict()
    sb = {k: v + 0.1 * torch.randn_like(v) if v.is_floating_point() else v for k, v in sa.items()}
    data = SimpleNamespace(batches=[(_fresh(inputs, 100 + i), None) for i in range(batches)])
    return canon, bound, sa, sb, data


def _recorded(canon: torch.nn.Module, bound: Any, state: dict[str, torch.Tensor], data: Any) -> dict[str, torch.Tensor]:
    """Every site's features over every batch, kept: what the statistics must summarise."""
    rec = SiteRecorder(canon, bound.problem, select=read_sites)
    feats = [rec.record(x, state) for x, _ in data.batches]
    return {k: torch.cat([f[k] for f in feats]) for k in feats[0]}


@pytest.mark.parametrize("name", FAMILIES)
def test_streamed_moments_equal_those_of_the_recorded_activations(name: str) -> None:
    canon, bound, sa, sb, data = _pair(name)
    moments = collect_moments(canon, bound.problem, sa, sb, data)
    fa, fb = _recorded(canon, bound, sa, data), _recorded(canon, bound, sb, data)
    assert set(moments.moments) == set(fa) and moments.batches == 3
    if name == "gpt_neox":  # the head-major QKV: its segments are index sets, not slices
        assert any(isinstance(i, torch.Tensor) for m in moments.moments.values() for i in m.index)
    exact = {"rtol": 1e-12, "atol": 1e-12}
    for site, m in moments.moments.items():
        xa, xb = fa[site], fb[site]
        assert m.count == xa.shape[0]
        covered = torch.cat([torch.arange(m.size)[idx] for idx in m.index])
        assert sorted(covered.tolist()) == list(range(m.size))  # the blocks are a partition of the features
        for idx, c, g in zip(m.index, m.cross, m.gram):
            torch.testing.assert_close(c, xa[:, idx].T @ xb[:, idx], **exact)
            if g is not None:
                torch.testing.assert_close(g, xb[:, idx].T @ xb[:, idx], **exact)
        torch.testing.assert_close(m.sum_a, xa.sum(0), **exact)
        torch.testing.assert_close(m.sum_b, xb.sum(0), **exact)
        torch.testing.assert_close(m.sq_a, xa.square().sum(0), **exact)
        torch.testing.assert_close(m.sq_b, xb.square().sum(0), **exact)


def test_a_permutation_or_orthogonal_site_never_builds_a_gram() -> None:
    canon, bound, sa, sb, data = _pair("nanogpt", batches=1)
    problem = bound.problem
    moments = collect_moments(canon, problem, sa, sb, data)
    mlp = [n for n in moments.moments if n.startswith("post:") and ".mlp." in n]
    attn = [n for n in moments.moments if n.startswith("out:") and "c_attn" in n]
    assert mlp and attn
    for name, m in moments.moments.items():
        site = moments.sites[name]
        perm_only = all(problem.spaces[s].group.permutation_subgroup() == problem.spaces[s].group for s in site.spaces())
        if perm_only:
            assert all(g is None for g in m.gram), name
            assert m.bytes == sum(c.numel() for c in m.cross) * 8 + 4 * m.size * 8  # cross and four vectors, no Gram
    for name in mlp:  # S(f): a permutation
        assert all(g is None for g in moments.moments[name].gram)
    for name in attn:  # positive control: the GL heads read their Gram, per segment (q, k, v), never across
        m = moments.moments[name]
        assert len(m.gram) == 3 and all(g is not None and g.shape == (m.size // 3,) * 2 for g in m.gram)
    assert all(needs_gram(problem, seg) for n in attn for seg in moments.sites[n].axis.segments)
    assert not any(needs_gram(problem, seg) for n in mlp for seg in moments.sites[n].axis.segments)
    # negative control: the unstreamed statistics, one block with its Gram per site
    full = ActivationMoments.empty(moments.sites.values())
    assert all(g is not None for m in full.moments.values() for g in m.gram)
    assert full.bytes > moments.bytes


def _unstreamed(canon: torch.nn.Module, bound: Any, sa: dict[str, torch.Tensor], sb: dict[str, torch.Tensor],
                data: Any) -> ActivationMoments:
    """The statistics as before streaming: both models recorded in full per batch, one
    block with its Gram per site."""
    rec = SiteRecorder(canon, bound.problem, select=read_sites)
    moments: ActivationMoments | None = None
    for x, _ in data.batches:
        fa, fb = rec.record(x, sa), rec.record(x, sb)
        moments = moments or ActivationMoments.empty(rec.sites or ())
        moments.update(fa, fb)
    assert moments is not None
    return moments


@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize("normalize", ["correlation", "none"])
def test_streamed_statistics_give_the_unstreamed_result(name: str, normalize: str) -> None:
    canon, bound, sa, sb, data = _pair(name)
    problem = bound.problem
    results = []
    for moments in (_unstreamed(canon, bound, sa, sb, data), collect_moments(canon, problem, sa, sb, data)):
        terms = activation_terms(problem, moments, normalize=normalize, dtype=torch.float64, ridge=1e-3, release=True)
        assert not moments.moments  # every site's moments let go once factored
        res = match_weights(terms.problem, terms.sd_a, terms.sd_b, rounds=3, tol=0.0)
        results.append((res, [h - terms.offset for h in res.history]))
    (full, full_history), (streamed, streamed_history) = results
    assert streamed_history == pytest.approx(full_history, rel=1e-9, abs=1e-12)
    for space, e in full.elements.items():
        for k, v in e.items():
            torch.testing.assert_close(streamed.elements[space][k], v, rtol=1e-7, atol=1e-9, msg=f"{space}.{k}")
