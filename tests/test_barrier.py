"""Loss barriers: the definition on known curves, and known answers on real (tiny, briefly
trained) models: a model with itself, B = g·A before and after alignment, a convex pair;
mean ± standard error over pairs; the JSON report against its schema; plots.
"""

from __future__ import annotations

import copy
import json
import math
import statistics
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from symspec.alignment import registered
from symspec.analyzers.barrier import (
    Measurer,
    accuracy_barrier,
    loss_barrier,
    mean_stderr,
    measure,
    pair_barrier,
    summarize,
)
from symspec.analyzers.interpolate import PathError, lambdas
from symspec.analyzers.report import REPORT_SCHEMA, BarrierReport
from symspec.analyzers.testing import fit, planted_pair
from symspec.data import DataError, EvalData, cross_entropy, load_data
from symspec.errors import SymspecInputError
from tests.cli_files import write_words
from tests.methods import Oracle
from tests.zoo import example

# ----------------------------------------------------------------------------- the definition


@given(st.integers(1, 20), st.floats(0.1, 5), st.floats(0.1, 5), st.floats(0.0, 3.0))
def test_a_parabolic_bump_has_its_height_as_barrier(half: int, la: float, lb: float, c: float) -> None:
    grid = lambdas(2 * half + 1)  # odd: λ = 0.5 is on the grid
    losses = [(1 - t) * la + t * lb + 4 * c * t * (1 - t) for t in grid]
    b = loss_barrier(grid, losses)
    assert b.value == pytest.approx(c, abs=1e-9)
    if c > 1e-9:
        assert b.peak_lambda == 0.5
    assert b.gaps[0] == 0.0 and b.gaps[-1] == 0.0


@given(st.integers(3, 41), st.floats(0.1, 5), st.floats(0.1, 5), st.floats(0.01, 3.0))
def test_a_convex_curve_has_barrier_zero_and_negative_interior(k: int, la: float, lb: float, c: float) -> None:
    grid = lambdas(k)
    losses = [(1 - t) * la + t * lb - 4 * c * t * (1 - t) for t in grid]
    b = loss_barrier(grid, losses)
    assert b.value == 0.0 and b.peak_lambda == 0.0
    assert b.interior_max is not None and b.interior_max < 0
    # the same curve turned upside down is a barrier
    flipped = [(1 - t) * la + t * lb + 4 * c * t * (1 - t) for t in grid]
    assert loss_barrier(grid, flipped).value > 0


def test_two_points_have_no_interior() -> None:
    b = loss_barrier([0.0, 1.0], [2.0, 3.0])
    assert (b.value, b.interior_max) == (0.0, None)


def test_a_diverging_midpoint_is_an_infinite_barrier() -> None:
    b = loss_barrier([0.0, 0.5, 1.0], [1.0, math.nan, 1.0])
    assert b.value == math.inf and b.peak_lambda == 0.5


def test_accuracy_barrier_measures_the_drop_below_the_line() -> None:
    b = accuracy_barrier([0.0, 0.5, 1.0], [0.9, 0.4, 0.8])
    assert b.value == pytest.approx(0.45) and b.peak_lambda == 0.5
    assert accuracy_barrier([0.0, 0.5, 1.0], [0.9, 0.95, 0.8]).value == 0.0


def test_barrier_input_errors() -> None:
    with pytest.raises(PathError, match="3 values of λ but 2"):
        loss_barrier([0.0, 0.5, 1.0], [1.0, 2.0])
    with pytest.raises(PathError, match="both endpoints"):
        loss_barrier([0.0, 0.5], [1.0, 2.0])


@given(st.lists(st.floats(-100, 100), min_size=2, max_size=30))
def test_mean_stderr_is_the_sample_standard_error(values: list[float]) -> None:
    mean, se = mean_stderr(values)
    assert mean == pytest.approx(statistics.fmean(values), abs=1e-9)
    assert se == pytest.approx(statistics.stdev(values) / math.sqrt(len(values)), abs=1e-9)


def test_one_value_has_no_standard_error() -> None:
    assert mean_stderr([0.3]) == (0.3, None)


# ----------------------------------------------------------------------------- trained tiny models

@pytest.fixture(scope="module")
def gpt_setup(tmp_path_factory: pytest.TempPathFactory) -> dict:
    path = tmp_path_factory.mktemp("text") / "words.txt"
    vocab = write_words(path)
    torch.manual_seed(0)
    model = example("nanogpt").build(vocab_size=vocab, block_size=16, n_layer=1, n_head=2, n_embd=16, n_ff=32)
    train = load_data(f"text:{path}", model=model, split="train", batch_size=32)
    losses = fit(model, train, steps=60, lr=2e-2)
    assert losses[-1] < 0.5 * losses[0]  # it learned something: the barrier tests below mean something
    val = load_data(f"text:{path}", model=model, split="val", batch_size=16)
    return {"model": model, "val": val, "path": path, "vocab": vocab}


@pytest.fixture(scope="module")
def vit_setup() -> dict:
    torch.manual_seed(0)
    model = example("vit").build(image_size=8, patch_size=4, n_layer=1, n_head=2, n_embd=16, mlp_ratio=2)
    losses = fit(model, load_data("digits", model=model, split="train", batch_size=64), steps=60, lr=1e-2)
    assert losses[-1] < 0.5 * losses[0]
    return {"model": model, "val": load_data("digits", model=model, split="val", batch_size=64)}


def as_model(module: torch.nn.Module, sd: dict[str, torch.Tensor]) -> torch.nn.Module:
    m = copy.deepcopy(module)
    m.load_state_dict(sd)
    return m.eval()


@pytest.mark.parametrize("setup", ["gpt_setup", "vit_setup"])
def test_a_model_with_itself_has_barrier_zero(setup: str, request: pytest.FixtureRequest) -> None:
    s = request.getfixturevalue(setup)
    r = pair_barrier(s["model"], s["model"], s["val"], points=11)
    assert abs(r.barrier.value) <= 1e-6 * r.curve.loss_a
    assert max(abs(g) for g in r.barrier.gaps) <= 1e-6 * r.curve.loss_a
    assert len(set(r.curve.losses)) == 1  # lerp(a, a, λ) is a, bit for bit
    # negative control: a perturbed copy is measurably different along the path
    other = copy.deepcopy(s["model"])
    with torch.no_grad():
        for p in other.parameters():
            p.add_(torch.randn_like(p) * 0.3 * p.std().clamp_min(1e-3))
    r2 = pair_barrier(s["model"], other, s["val"], points=11)
    assert max(abs(g) for g in r2.barrier.gaps) > 1e-3


@pytest.mark.parametrize("setup, spec", [("gpt_setup", "nanogpt"), ("vit_setup", "vit")])
def test_planted_symmetry_has_a_barrier_that_alignment_removes(setup: str, spec: str,
                                                               request: pytest.FixtureRequest) -> None:
    s = request.getfixturevalue(setup)
    planted = planted_pair(s["model"], spec, seed=3)
    a, b = as_model(planted.module, planted.sd_a), as_model(planted.module, planted.sd_b)
    key = next(k for k in planted.sd_b if k.endswith("head.weight"))
    with registered(Oracle([planted], key=key)):
        res = measure([(a, b)], s["val"], methods=["none", "planted"], points=11, spec=spec)
    before, after = res["none"][0], res["planted"][0]
    # g preserves the function: both endpoints have A's loss
    assert before.curve.loss_b == pytest.approx(before.curve.loss_a, rel=1e-5)
    assert before.barrier.value > 0.1 and 0 < before.barrier.peak_lambda < 1
    assert after.barrier.value <= 1e-5
    assert max(after.curve.losses) - min(after.curve.losses) <= 1e-5
    if before.accuracy_barrier is not None:
        assert before.accuracy_barrier.value > after.accuracy_barrier.value  # type: ignore[union-attr]


def test_weight_matching_removes_the_planted_barrier(gpt_setup: dict) -> None:
    planted = planted_pair(gpt_setup["model"], "nanogpt", seed=5)
    a, b = as_model(planted.module, planted.sd_a), as_model(planted.module, planted.sd_b)
    res = measure([(a, b)], gpt_setup["val"], methods=["none", "weight"], spec="nanogpt", points=11)
    assert res["none"][0].barrier.value > 0.1
    assert res["weight"][0].barrier.value <= 1e-4
    assert res["weight"][0].align_seconds > 0


def test_permutation_only_matching_undoes_a_planted_permutation_but_not_a_rotation(gpt_setup: dict) -> None:
    for spaces, perm_recovers in ((["ff[0]"], True), (None, False)):
        planted = planted_pair(gpt_setup["model"], "nanogpt", seed=5, spaces=spaces)
        a, b = as_model(planted.module, planted.sd_a), as_model(planted.module, planted.sd_b)
        res = measure([(a, b)], gpt_setup["val"], methods=["none", "weight-perm", "weight"], spec="nanogpt", points=11)
        none, perm, full = (res[m][0].barrier.value for m in ("none", "weight-perm", "weight"))
        assert none > 0.05 and full <= 1e-4
        if perm_recovers:
            assert perm <= 1e-4
        else:  # a residual rotation is out of reach of permutations
            assert perm > 0.05
        assert res["weight"][0].align_info["rounds"] >= 1 and res["weight"][0].align_seconds > 0


def test_weight_alignment_without_a_spec_is_an_input_error(gpt_setup: dict) -> None:
    m = gpt_setup["model"]
    with pytest.raises(SymspecInputError, match="weight matching needs a spec"):
        pair_barrier(m, m, gpt_setup["val"], method="weight", spec=None)
    # vanilla averaging needs none
    assert pair_barrier(m, m, gpt_setup["val"], method="none", spec=None, points=3).barrier.value == 0.0


def test_unknown_methods_are_named(gpt_setup: dict) -> None:
    m = gpt_setup["model"]
    with pytest.raises(SymspecInputError, match="unknown alignment method 'wieght'; did you mean 'weight'"):
        measure([(m, m)], gpt_setup["val"], methods=["wieght"])


# ----------------------------------------------------------------------------- a convex pair

def softmax_regression_data(seed: int = 0) -> EvalData:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(120, 5, generator=g)
    y = (x @ torch.randn(5, 3, generator=g)).argmax(1)
    return EvalData("blobs", "hook", "val", [((x[i : i + 50],), y[i : i + 50]) for i in range(0, 120, 50)],
                    cross_entropy, None)


@given(st.integers(0, 10_000), st.integers(0, 10_000))
def test_a_convex_pair_has_no_barrier(seed_a: int, seed_b: int) -> None:
    # cross-entropy of a linear classifier is convex in its weights: the path lies below the line
    torch.manual_seed(seed_a)
    a = torch.nn.Linear(5, 3)
    torch.manual_seed(seed_b + 10_001)
    b = torch.nn.Linear(5, 3)
    r = pair_barrier(a, b, softmax_regression_data(), points=9)
    assert r.barrier.value <= 0.0
    assert r.barrier.interior_max is not None and r.barrier.interior_max < 0


def test_a_non_convex_pair_of_the_same_data_has_a_barrier() -> None:
    # negative control for the convex test: a ReLU network and its hidden units permuted
    torch.manual_seed(0)
    data = softmax_regression_data()
    a = torch.nn.Sequential(torch.nn.Linear(5, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    fit(a, data, steps=150, lr=3e-2)
    perm = torch.randperm(16)
    b = copy.deepcopy(a)
    with torch.no_grad():
        b[0].weight.copy_(a[0].weight[perm])
        b[0].bias.copy_(a[0].bias[perm])
        b[2].weight.copy_(a[2].weight[:, perm])
    r = pair_barrier(a, b, data, points=9)
    assert r.curve.loss_a == pytest.approx(r.curve.loss_b, rel=1e-5)
    assert r.barrier.value > 0.05


# ----------------------------------------------------------------------------- several pairs, report, plot

@pytest.fixture(scope="module")
def three_pairs(gpt_setup: dict) -> dict:
    pairs = []
    planted = []
    for seed in (11, 12, 13):
        p = planted_pair(gpt_setup["model"], "nanogpt", seed=seed)
        planted.append(p)
        pairs.append((as_model(p.module, p.sd_a), as_model(p.module, p.sd_b)))
    return {"pairs": pairs, "planted": planted, "val": gpt_setup["val"]}


def test_several_pairs_give_mean_and_standard_error(three_pairs: dict) -> None:
    calls: list[int] = []
    res = measure(three_pairs["pairs"], three_pairs["val"], methods=["none"], points=5, progress=calls.append)
    assert sum(calls) == 3 * 5 * len(three_pairs["val"].batches)
    values = [r.barrier.value for r in res["none"]]
    assert len(set(values)) == 3  # three different g, three different barriers
    s = summarize(res["none"])
    assert s.n == 3
    assert s.barrier_mean == pytest.approx(statistics.fmean(values))
    assert s.barrier_stderr == pytest.approx(statistics.stdev(values) / math.sqrt(3))
    assert s.loss_mean[2] == pytest.approx(statistics.fmean(r.curve.losses[2] for r in res["none"]))


def test_report_follows_its_schema_and_summary_and_plot_show_it(three_pairs: dict, tmp_path: Path) -> None:
    jsonschema = pytest.importorskip("jsonschema")
    with registered(Oracle(three_pairs["planted"])):
        res = measure(three_pairs["pairs"], three_pairs["val"], methods=["none", "planted"], points=5, spec="nanogpt")
    report = BarrierReport.build(three_pairs["val"], res, seconds=1.0)
    doc = json.loads(report.to_json())
    jsonschema.validate(doc, REPORT_SCHEMA)
    assert [m["method"] for m in doc["methods"]] == ["none", "planted"]
    assert doc["methods"][0]["summary"]["barrier_mean"] == pytest.approx(summarize(res["none"]).barrier_mean)
    assert doc["points"] == 5 and doc["data"]["split"] == "val" and len(doc["pairs"]) == 3
    # the schema has teeth
    broken = json.loads(report.to_json())
    del broken["methods"][0]["summary"]["barrier_stderr"]
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(broken, REPORT_SCHEMA)
    broken = json.loads(report.to_json())
    broken["points"] = 1
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(broken, REPORT_SCHEMA)

    md = report.markdown()
    s = summarize(res["none"])
    assert f"{s.barrier_mean:.4f} ± {s.barrier_stderr:.4f}" in md
    assert "| vanilla averaging | 3 |" in md and "| planted | 3 |" in md

    png = report.plot(tmp_path / "curves.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_non_finite_numbers_stay_valid_json(three_pairs: dict) -> None:
    jsonschema = pytest.importorskip("jsonschema")
    res = measure(three_pairs["pairs"][:1], three_pairs["val"], points=3)
    r = res["none"][0]
    bad = type(r)(r.method, r.pair, r.a, r.b, type(r.curve)(r.curve.lambdas, (1.0, math.nan, 1.0)),
                  loss_barrier(r.curve.lambdas, (1.0, math.nan, 1.0)), None)
    doc = json.loads(BarrierReport.build(three_pairs["val"], {"none": [bad]}).to_json())
    jsonschema.validate(doc, REPORT_SCHEMA)
    assert doc["methods"][0]["pairs"][0]["barrier"] == "inf"


# ----------------------------------------------------------------------------- bad pairs

def test_pairs_of_different_shapes_are_refused(gpt_setup: dict) -> None:
    torch.manual_seed(0)
    wide = example("nanogpt").build(vocab_size=gpt_setup["vocab"], block_size=16, n_layer=1, n_head=2, n_embd=24, n_ff=32)
    with pytest.raises(PathError, match=r"not two models of one architecture.*shape"):
        pair_barrier(gpt_setup["model"], wide, gpt_setup["val"])


def test_data_that_do_not_fit_one_of_the_models_are_refused(gpt_setup: dict) -> None:
    torch.manual_seed(0)
    other = example("nanogpt").build(vocab_size=gpt_setup["vocab"] + 3, block_size=16, n_layer=1, n_head=2, n_embd=16, n_ff=32)
    with pytest.raises(DataError, match=r"the model predicts .* classes but the text's alphabet has"):
        Measurer(gpt_setup["val"]).pair(other, other, names=("X", "Y"))


def test_fewer_than_two_points_are_refused_by_the_api(gpt_setup: dict) -> None:
    m = gpt_setup["model"]
    with pytest.raises(PathError, match="at least 2 points"):
        pair_barrier(m, m, gpt_setup["val"], points=1)
