"""N-model analyzers (symspec.analyzers.simplex): the grid, combinations, deviations, the
merge analysis on planted models (an oracle: aligned deviations are 0), plots, the schema."""

from __future__ import annotations

import math
from typing import Any

import jsonschema
import pytest
import torch

from symspec.analyzers.interpolate import PathEvaluator
from symspec.analyzers.simplex import (
    ANALYSIS_SCHEMA,
    SimplexError,
    SimplexSurface,
    analyze_merge,
    combine,
    default_resolution,
    evaluations,
    plot_simplex,
    simplex_grid,
    simplex_surface,
)
from symspec.analyzers.testing import fit
from symspec.binding import bind
from symspec.data import EvalData, argmax_accuracy, cross_entropy
from symspec.errors import SymspecInputError
from symspec.spec import load_spec
from symspec.transforms import apply_elements, canonicalize_model, sample_elements
from tests.zoo import ZOO


def test_simplex_grid() -> None:
    for n, r in [(2, 4), (3, 12), (4, 3), (5, 2)]:
        grid = simplex_grid(n, r)
        assert len(grid) == math.comb(r + n - 1, n - 1) == len(set(grid))
        assert all(len(w) == n and abs(sum(w) - 1) < 1e-12 and min(w) >= 0 for w in grid)
        vertices = [tuple(1.0 if j == i else 0.0 for j in range(n)) for i in range(n)]
        assert all(v in grid for v in vertices)
        assert grid == sorted(grid)
    assert any(all(abs(x - 1 / 3) < 1e-15 for x in w) for w in simplex_grid(3, 3))
    assert not any(all(abs(x - 1 / 3) < 1e-9 for x in w) for w in simplex_grid(3, 4))
    with pytest.raises(SimplexError, match="resolution >= 1"):
        simplex_grid(3, 0)
    assert [default_resolution(n) for n in (2, 3, 4, 5, 10, 30)] == [12, 12, 6, 4, 2, 1]
    assert default_resolution(3, budget=10) == 3


def test_combine() -> None:
    a = {"w": torch.tensor([1.0, 2.0]), "i": torch.tensor([7])}
    b = {"w": torch.tensor([3.0, -2.0]), "i": torch.tensor([9])}
    c = {"w": torch.tensor([0.0, 4.0]), "i": torch.tensor([9])}
    out = combine([a, b, c], (0.5, 0.25, 0.25))
    assert out["w"].tolist() == [1.25, 1.5] and out["i"].tolist() == [7]
    buf = {"w": torch.empty(2)}
    same = buf["w"]
    combine([a, b, c], (0.0, 0.0, 1.0), out=buf)
    assert buf["w"] is same and buf["w"].tolist() == [0.0, 4.0]
    with pytest.raises(SimplexError, match="3 models but 2 weights"):
        combine([a, b, c], (0.5, 0.5))


def _surface(n: int, res: int, ends: list[float], bump: float) -> SimplexSurface:
    """Losses Σ w L_i + bump·(1 - Σ w²): deviation bump·(1 - Σ w²), 0 at the vertices."""
    grid = simplex_grid(n, res)
    losses = [sum(w * e for w, e in zip(ws, ends)) + bump * (1 - sum(w * w for w in ws)) for ws in grid]
    return SimplexSurface("universe", tuple(f"m{i}" for i in range(n)), res, tuple(grid), tuple(losses), None)


def test_deviation_and_its_maximum() -> None:
    s = _surface(3, 6, [1.0, 2.0, 4.0], bump=0.3)
    assert s.endpoint_losses == (1.0, 2.0, 4.0)
    assert max(abs(d - 0.3 * (1 - sum(w * w for w in ws))) for d, ws in zip(s.deviations, s.weights)) < 1e-12
    assert s.max_deviation == pytest.approx(0.3 * (1 - 1 / 3))
    assert s.argmax == pytest.approx((1 / 3, 1 / 3, 1 / 3))
    assert s.centroid_deviation == pytest.approx(s.max_deviation)
    # a convex basin: every combination is better than its endpoints, the barrier is 0 (vertices)
    low = _surface(3, 6, [1.0, 2.0, 4.0], bump=-0.3)
    assert low.max_deviation == pytest.approx(0.0, abs=1e-12) and min(low.deviations) < -0.1
    assert _surface(3, 4, [1.0, 1.0, 1.0], 0.1).centroid_deviation is None  # 1/3 is not on a grid of quarters
    nan = SimplexSurface("plain", ("a", "b"), 2, ((0.0, 1.0), (0.5, 0.5), (1.0, 0.0)), (1.0, math.nan, 1.0), None)
    assert nan.max_deviation == math.inf and nan.to_dict()["max_deviation"] == "inf"


# --------------------------------------------------------------------------- on models

VOCAB = 11


def _data(n_seq: int = 24, t: int = 8) -> EvalData:
    """Sequences counting up mod VOCAB: next-token prediction a tiny model learns fast."""
    starts = torch.arange(n_seq) % VOCAB
    seq = (starts[:, None] + torch.arange(t + 1)[None, :]) % VOCAB
    x, y = seq[:, :-1], seq[:, 1:]
    return EvalData("counting", "hook", "val", [((x[:12],), y[:12]), ((x[12:],), y[12:])], cross_entropy, argmax_accuracy)


@pytest.fixture(scope="module")
def planted() -> dict[str, Any]:
    """A trained A (float64) and three models g_i·A in canonical form; aligned, all are A."""
    model, _ = ZOO["nanogpt"](seed=0, n_layer=1)
    model = model.double()
    data = _data()
    fit(model, data, steps=120, lr=1e-2)
    bound = bind(load_spec("nanogpt"), model)
    canon = canonicalize_model(bound, model)
    a = {k: v.detach() for k, v in canon.state_dict().items()}
    models = [apply_elements(bound.problem, sample_elements(bound.problem, seed=i), a) for i in range(3)]
    return {"module": canon, "a": a, "models": models, "data": data}


def test_aligned_simplex_of_planted_models_is_flat_and_plain_averaging_is_not(planted: dict[str, Any]) -> None:
    p = planted
    calls: list[int] = []
    res = analyze_merge(module=p["module"], canonical_module=p["module"], n=3, names=["x", "y", "z"],
                        load_raw=lambda i: p["models"][i], load_aligned=lambda i: p["a"], merged=p["a"],
                        data=p["data"], resolution=3, progress=calls.append)
    assert sum(calls) == evaluations(3, p["data"], resolution=3)
    ends = [e.loss for e in res.endpoints]
    assert max(ends) - min(ends) < 1e-9  # g·A computes what A computes
    assert res.endpoint_mean < 1.0  # A learned the task (chance: log 11 = 2.4)
    assert all(abs(a.loss - e) < 1e-9 for a, e in zip(res.aligned, ends))
    assert abs(res.merged.loss - res.endpoint_mean) < 1e-9
    plain, uni = res.surface("plain"), res.surface("universe")
    assert plain is not None and uni is not None
    assert max(abs(d) for d in uni.deviations) < 1e-9
    assert plain.max_deviation > 0.1 and res.plain.loss > res.endpoint_mean + 0.1
    assert plain.centroid_deviation == pytest.approx(res.plain.loss - res.endpoint_mean, abs=1e-12)
    doc = res.to_dict()
    jsonschema.validate(doc, ANALYSIS_SCHEMA)
    assert doc["merged_gap"] == pytest.approx(0.0, abs=1e-9) and doc["plain_gap"] > 0.1
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({k: v for k, v in doc.items() if k != "merged"}, ANALYSIS_SCHEMA)


def test_no_simplex_by_default_for_more_than_three_models(planted: dict[str, Any]) -> None:
    p = planted
    four = [*p["models"], p["a"]]
    res = analyze_merge(module=p["module"], canonical_module=p["module"], n=4, names=list("wxyz"),
                        load_raw=lambda i: four[i], load_aligned=lambda i: p["a"], merged=p["a"], data=p["data"])
    assert res.surfaces == [] and len(res.endpoints) == 4
    ev = PathEvaluator(p["module"], p["data"])
    s = simplex_surface(ev, four, method="plain", resolution=2)
    assert len(s.weights) == math.comb(5, 3) and s.names == ("model0", "model1", "model2", "model3")
    with pytest.raises(SimplexError, match="at least 2 models"):
        simplex_surface(ev, four[:1], method="plain")
    wrong = dict(p["a"])
    wrong.pop("lm_head.weight")
    with pytest.raises(SymspecInputError, match="lacks 1 tensor"):
        simplex_surface(ev, [p["a"], wrong], method="plain", names=["a", "broken"])


def test_plot_simplex(tmp_path: Any) -> None:
    out = plot_simplex([_surface(3, 6, [1, 2, 3], 0.2), _surface(3, 6, [1, 2, 3], -0.2)], tmp_path / "s.png", title="t")
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    with pytest.raises(SimplexError, match="three models"):
        plot_simplex([_surface(2, 4, [1, 2], 0.2)], tmp_path / "no.png")
    assert not (tmp_path / "no.png").exists()
