"""Function preservation: every declared symmetry holds, and wrong specs are caught."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import symspec
from symspec.binding import bind
from symspec.checker import check
from symspec.spec import loads_spec
from symspec.testing import assert_invariant, assert_not_invariant
from symspec.transforms import apply_elements, canonicalize_model, sample_elements
from tests.zoo import SPECS, ZOO, example, variant

sizes = st.fixed_dictionaries({
    "n_layer": st.integers(1, 3),
    "n_head": st.integers(1, 4),
    "head_dim": st.integers(2, 8),
    "seed": st.integers(0, 2**16),
})


@given(sizes, st.integers(2, 24))
def test_nanogpt_symmetries_preserve_function(size: dict, n_ff: int) -> None:  # type: ignore[type-arg]
    model, inputs = ZOO["nanogpt"](n_ff=n_ff, **size)
    report = check(model, symspec.load_spec("nanogpt"), inputs, samples=2, seed=size["seed"], dtypes=("float64",))
    assert report.passed, report.render()
    assert {r.space for r in report.rows} >= {"canonicalize", "resid", "ff[*]", "attn[*]"}
    assert all(r.max_rel <= 1e-9 for r in report.rows)


@given(sizes, st.integers(1, 4))
def test_vit_symmetries_preserve_function(size: dict, ratio: int) -> None:  # type: ignore[type-arg]
    model, inputs = ZOO["vit"](mlp_ratio=ratio, **size)
    report = check(model, symspec.load_spec("vit"), inputs, samples=2, seed=size["seed"], dtypes=("float64",))
    assert report.passed, report.render()
    assert all(r.max_rel <= 1e-9 for r in report.rows)


@given(sizes)
def test_transformed_models_agree_directly(size: dict) -> None:  # type: ignore[type-arg]
    # An independent oracle to check(): load the transformed weights into a fresh
    # model of the same class and compare logits.
    model, inputs = ZOO["nanogpt"](**size)
    model = model.double()
    bound = bind(symspec.load_spec("nanogpt"), model)
    canon = canonicalize_model(bound, model)
    elems = sample_elements(bound.problem, seed=size["seed"])
    sd = apply_elements(bound.problem, elems, canon.state_dict())
    other = canonicalize_model(bound, model)
    other.load_state_dict(sd)
    with torch.no_grad():
        y0, y1, y2 = model(*inputs), canon(*inputs), other(*inputs)
    scale = y0.abs().max()
    assert (y0 - y1).abs().max() / scale <= 1e-9
    assert (y0 - y2).abs().max() / scale <= 1e-9
    moved = [k for k in sd if not torch.equal(sd[k], canon.state_dict()[k])]
    assert len(moved) > len(sd) // 2  # the transform really moved the weights


def test_float32_check_passes_within_documented_tolerance() -> None:
    model, inputs = ZOO["nanogpt"](n_layer=2, n_head=4, head_dim=8)
    report = assert_invariant(model, "nanogpt", inputs, dtypes=("float32",))
    assert all(r.rtol == 1e-4 and r.max_rel < 1e-5 for r in report.rows)


# -- wrong specs must be caught -----------------------------------------------------------------

def test_orthogonal_group_on_a_gelu_ff_space_fails_and_names_it() -> None:
    model, inputs = ZOO["nanogpt"](n_layer=2)
    spec = variant("nanogpt", ("group: S(f)", "group: O(f)"))
    report = assert_not_invariant(model, spec, inputs)
    failed = {r.space for r in report.failed_rows()}
    assert "ff[*]" in failed and "resid" not in failed and "attn[*]" not in failed
    ff_row = next(r for r in report.failed_rows() if r.space == "ff[*]")
    assert ff_row.failing == ("ff[0]", "ff[1]") and ff_row.max_rel > 1e-3


def test_qk_without_the_dual_pairing_fails() -> None:
    model, inputs = ZOO["vit"]()
    spec = variant("vit", ('blocks.{i}.attn.k.weight: ["attn[i].qk*", resid*]', 'blocks.{i}.attn.k.weight: ["attn[i].qk", resid*]'),
                   ('blocks.{i}.attn.k.bias: ["attn[i].qk*"]', 'blocks.{i}.attn.k.bias: ["attn[i].qk"]'))
    report = assert_not_invariant(model, spec, inputs)
    assert {r.space for r in report.failed_rows()} == {"attn[*]", "all"}
    # the same binding is fine under an orthogonal within-head group: co == contra there
    spec_o = variant("vit", ('blocks.{i}.attn.k.weight: ["attn[i].qk*", resid*]', 'blocks.{i}.attn.k.weight: ["attn[i].qk", resid*]'),
                     ('blocks.{i}.attn.k.bias: ["attn[i].qk*"]', 'blocks.{i}.attn.k.bias: ["attn[i].qk"]'),
                     ("Heads(H, qk=GL(dh), ov=GL(dh))", "Heads(H, qk=O(dh), ov=GL(dh))"))
    assert_invariant(model, spec_o, inputs)


def test_residual_rotation_needs_the_layernorm_canonicalisation() -> None:
    model, inputs = ZOO["vit"]()
    text = (SPECS / "vit.yaml").read_text()
    head, _, rest = text.partition("canonicalize:")
    _, _, params = rest.partition("params:")
    without = loads_spec(head + "params:" + params, "vit-no-canon.yaml")
    report = assert_not_invariant(model, without, inputs)
    assert "resid" in {r.space for r in report.failed_rows()}
    assert "ff[*]" not in {r.space for r in report.failed_rows()}
    assert_invariant(model, symspec.load_spec("vit"), inputs)
    # OC(d) commutes with the centring inside LayerNorm, so once the gains are folded it
    # holds even without mean-centring (centring removes a component LayerNorm ignores,
    # which matters for matching, not for function preservation) ...
    only_fold = loads_spec(text.split("  - center:")[0] + "\nparams:" + params, "vit-fold-only.yaml")
    assert_invariant(model, only_fold, inputs)
    # ... while the full O(d), which moves the all-ones direction, fails even canonicalised.
    full_o = variant("vit", ("resid: OC(d)", "resid: O(d)"))
    assert "resid" in {r.space for r in assert_not_invariant(model, full_o, inputs).failed_rows()}


def test_a_wrong_canonicalisation_is_caught() -> None:
    model, inputs = ZOO["nanogpt"]()
    # ln_2 folded into the attention input instead of the MLP input
    spec = variant("nanogpt", ('{weight: "transformer.h.{i}.mlp.c_fc.weight", axis: 1, bias: "transformer.h.{i}.mlp.c_fc.bias"}',
                               '{weight: "transformer.h.{i}.attn.c_attn.weight", axis: 1, bias: "transformer.h.{i}.attn.c_attn.bias"}'))
    report = assert_not_invariant(model, spec, inputs)
    assert "canonicalize" in {r.space for r in report.failed_rows()}


def test_check_restricted_to_spaces_and_unknown_space() -> None:
    model, inputs = ZOO["nanogpt"]()
    report = check(model, symspec.load_spec("nanogpt"), inputs, spaces=["ff"], samples=1)
    assert {r.space for r in report.rows} == {"canonicalize", "ff[*]", "all"}
    with pytest.raises(symspec.SymspecInputError, match="did you mean 'ff'"):
        check(model, symspec.load_spec("nanogpt"), inputs, spaces=["fff"])


def test_report_json_round_trip() -> None:
    import json

    model, inputs = ZOO["vit"]()
    report = check(model, symspec.load_spec("vit"), inputs, samples=1)
    data = json.loads(report.to_json())
    assert data["passed"] is True and data["spec"] == "vit" and data["model"] == "ViT"
    assert {row["dtype"] for row in data["rows"]} == {"float64", "float32"}


def test_example_models_and_graph_sites() -> None:
    mod = example("nanogpt")
    model = mod.build(n_layer=2)
    inputs = mod.example_inputs(model)
    bound = bind(symspec.load_spec("nanogpt"), model, example_inputs=inputs, trace=True)
    assert bound.graph.method == "symbolic_trace"
    ff0 = {s.kind for s in bound.graph.sites["ff[0]"]}
    assert ff0 == {"pre", "post"}
    assert any(s.module.endswith("mlp.gelu") for s in bound.graph.sites["ff[0]"])
