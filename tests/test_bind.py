"""Binding a spec to a model: every refusal is located and explains itself."""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import symspec
from symspec.binding import bind, fill, template_regex
from symspec.errors import BindError
from symspec.spec import loads_spec
from symspec.transforms import apply_elements, sample_elements
from tests.zoo import SPECS, ZOO
from tests.zoo import variant as zoo_variant


def variant(name: str, *replacements: tuple[str, str]) -> symspec.Spec:
    return zoo_variant(name, *replacements, filename=f"{name}.yaml")  # messages name vit.yaml


def bind_errors(spec: symspec.Spec, model: torch.nn.Module) -> list[str]:
    with pytest.raises(BindError) as info:
        bind(spec, model)
    return [str(d) for d in info.value.diagnostics]


def line_of(name: str, needle: str) -> int:
    for i, line in enumerate((SPECS / f"{name}.yaml").read_text().splitlines(), 1):
        if needle in line:
            return i
    raise AssertionError(needle)


def test_binding_resolves_spaces_shapes_and_instances() -> None:
    model, _ = ZOO["nanogpt"](n_layer=3, n_head=2, head_dim=4, n_ff=12)
    bound = bind(symspec.load_spec("nanogpt"), model)
    assert bound.dims == {"d": 8, "H": 2, "dh": 4, "f": 12}
    assert list(bound.spaces) == ["resid", "attn[0]", "attn[1]", "attn[2]", "ff[0]", "ff[1]", "ff[2]"]
    pb = bound.problem.params["transformer.h.1.attn.c_attn.weight"]
    segs = pb.axes[0].segments
    assert [(s.start, s.size) for s in segs] == [(0, 8), (8, 8), (16, 8)]
    assert [str(f) for s in segs for f in s.factors] == ["attn[1].qk", "attn[1].qk*", "attn[1].ov"]
    assert bound.problem.ties == ()  # untied by the spec
    assert bound.model_ties == (("transformer.wte.weight", "lm_head.weight"),)
    assert "transformer.h.2.ln_1.weight" in bound.problem.invariants
    incid = list(bound.problem.incidences("ff[2]"))
    assert {(i.param, i.axis) for i in incid} == {
        ("transformer.h.2.mlp.c_fc.weight", 0), ("transformer.h.2.mlp.c_fc.bias", 0), ("transformer.h.2.mlp.c_proj.weight", 1)}


def test_a_binding_that_matches_nothing() -> None:
    model, _ = ZOO["vit"]()
    spec = variant("vit", ("blocks.{i}.fc1.weight:", "blocks.{i}.fc_1.weight:"))
    errs = bind_errors(spec, model)
    line = line_of("vit", "blocks.{i}.fc1.weight: [")
    assert any(e.startswith(f"vit.yaml:{line}:3: params[blocks.{{i}}.fc_1.weight]: 'blocks.{{i}}.fc_1.weight' matches no parameter of ViT; did you mean")
               and "blocks.0.fc1.weight" in e for e in errs), errs
    # the real fc1 weights are now unaccounted for, and said so
    assert any("neither bound nor declared invariant: blocks.0.fc1.weight, blocks.1.fc1.weight" in e for e in errs), errs


def test_a_shape_that_contradicts_the_dimensions() -> None:
    model, _ = ZOO["vit"]()
    spec = variant("vit", ('f: shape("blocks.0.fc1.weight", 0)', "f: 3 * d"))
    errs = bind_errors(spec, model)
    assert any("blocks.0.fc1.weight: axis 0 has size 16, but 'ff[i]' (ff[0]: S(24)) expects 24" in e for e in errs), errs
    assert all(re.match(r"vit\.yaml:\d+:\d+: ", e) for e in errs)


def test_a_concatenated_axis_reports_its_parts() -> None:
    model, _ = ZOO["nanogpt"]()
    spec = variant("nanogpt", ("- cat(attn[i].qk, attn[i].qk*, attn[i].ov)    # q, k", "- cat(attn[i].qk, attn[i].ov)    # q, k"))
    errs = bind_errors(spec, model)
    assert any("c_attn.weight: axis 0 has size 24, but 'cat(attn[i].qk, attn[i].ov)' (attn[0]: Heads(2, qk=GL(4), ov=GL(4))) expects 16 = 8 + 8" in e for e in errs), errs


def test_an_unaccounted_parameter() -> None:
    model, _ = ZOO["vit"]()
    spec = variant("vit", ("  head.bias: invariant\n", ""))
    errs = bind_errors(spec, model)
    assert errs == ["vit.yaml: params: 1 parameter(s) of ViT are neither bound nor declared invariant: head.bias; "
                    "a spec must account for every parameter: bind it to a space or declare it 'invariant'"]


def test_wrong_number_of_axes_and_bad_dimension() -> None:
    model, _ = ZOO["vit"]()
    spec = variant("vit", ("cls_token: [_, _, resid]", "cls_token: [_, resid]"), ("H: config.n_head", "H: config.num_heads"))
    errs = bind_errors(spec, model)
    assert any("cls_token has 3 axes (shape [1, 1, 8]), the spec gives 2" in e for e in errs), errs
    assert any("dimension H = config.num_heads: 'config.num_heads': config has no 'num_heads'" in e for e in errs), errs


def test_tied_parameters_that_the_group_would_untie_are_rejected() -> None:
    model, _ = ZOO["nanogpt"]()
    # Without the declared untie, folding ln_f into lm_head would silently untie it.
    spec = variant("nanogpt", ("  - untie: lm_head.weight\n", ""))
    errs = bind_errors(spec, model)
    assert any("fold_norm changes lm_head.weight, which is tied to transformer.wte.weight; that would untie them; declare '- untie: lm_head.weight'" in e for e in errs), errs
    assert any("center changes transformer.wte.weight, which is tied to lm_head.weight" in e for e in errs), errs


def test_tied_parameters_under_a_non_orthogonal_group_are_rejected() -> None:
    model, _ = ZOO["nanogpt"]()
    # keep the tie (no untie, no ln_f fold, no embedding centring), and make the residual GL(d)
    text = (SPECS / "nanogpt.yaml").read_text()
    text = text.replace("  - untie: lm_head.weight\n", "").replace("resid: OC(d)", "resid: GL(d)").replace("    group: OC(d)", "    group: GL(d)")
    text = text.replace("""  - fold_norm:
      gain: transformer.ln_f.weight
      bias: transformer.ln_f.bias
      fold_bias: false        # lm_head has no bias: ln_f's bias stays, and rotates with the residual
      into:
        - {weight: lm_head.weight, axis: 1}
""", "").replace("        transformer.wte.weight: 1\n", "")
    errs = bind_errors(loads_spec(text, "nanogpt.yaml"), model)
    assert any("tied parameters transformer.wte.weight (resid) and lm_head.weight (resid*) need different transforms under GL(8)" in e
               and "the group would untie them" in e for e in errs), errs
    # under an orthogonal group the same two bindings ask for the same transform
    ok = loads_spec(text.replace("group: GL(d)", "group: S(d)"), "nanogpt.yaml")
    assert bind(ok, model).problem.ties == (("transformer.wte.weight", "lm_head.weight"),)


def test_undeclared_and_false_ties() -> None:
    model, _ = ZOO["nanogpt"]()
    spec = variant("nanogpt", ("ties:\n  - [transformer.wte.weight, lm_head.weight]\n", ""), ("  - untie: lm_head.weight\n", ""))
    errs = bind_errors(spec, model)
    assert any("GPT ties transformer.wte.weight and lm_head.weight (one shared tensor), but the spec does not declare it" in e for e in errs), errs
    untied, _ = ZOO["vit"]()
    spec = variant("vit", ("params:\n", "ties:\n  - [head.weight, blocks.0.fc1.weight]\nparams:\n"))
    errs = bind_errors(spec, untied)
    assert any("head.weight and blocks.0.fc1.weight are declared tied, but ViT stores them separately" in e for e in errs), errs


def test_transform_keeps_shared_ties_shared() -> None:
    # A spec keeping the tie (S(d) residual on a model without ln_f gain folding) leaves
    # tied entries as one tensor.
    model, _ = ZOO["nanogpt"]()
    text = (SPECS / "nanogpt.yaml").read_text().split("canonicalize:")[0] + "params:" + (SPECS / "nanogpt.yaml").read_text().split("params:")[1]
    text = text.replace("group: OC(d)", "group: S(d)").replace("transformer.ln_f.weight: invariant", "transformer.ln_f.weight: [resid]")
    for ln in ("ln_1", "ln_2"):
        text = text.replace(f"transformer.h.{{i}}.{ln}.weight: invariant", f"transformer.h.{{i}}.{ln}.weight: [resid]")
        text = text.replace(f"transformer.h.{{i}}.{ln}.bias: invariant", f"transformer.h.{{i}}.{ln}.bias: [resid]")
    spec = loads_spec(text, "nanogpt-perm.yaml")
    bound = bind(spec, model)
    assert bound.problem.ties == (("transformer.wte.weight", "lm_head.weight"),)
    sd = model.state_dict()
    out = apply_elements(bound.problem, sample_elements(bound.problem, seed=3), sd)
    assert out["transformer.wte.weight"] is out["lm_head.weight"]
    symspec.testing.assert_invariant(model, spec, ZOO["nanogpt"]()[1])


@given(st.lists(st.sampled_from(["a", "b", "h.{i}", "{j}", "x_1"]), min_size=1, max_size=4), st.integers(0, 99), st.integers(0, 99))
def test_template_regex_inverts_fill(parts: list[str], i: int, j: int) -> None:
    template = ".".join(parts)
    caps = {k: v for k, v in (("i", i), ("j", j)) if f"{{{k}}}" in template}
    if len(set(re.findall(r"\{(\w+)\}", template))) != len(re.findall(r"\{(\w+)\}", template)):
        return  # a template may not capture the same name twice (the spec rejects it)
    name = fill(template, caps)
    m = template_regex(template).fullmatch(name)
    assert m is not None and {k: int(v) for k, v in m.groupdict().items()} == caps


@pytest.mark.parametrize("spec", [None, 3, object()], ids=["none", "int", "object"])
def test_bind_refuses_a_spec_of_the_wrong_type(spec: Any) -> None:
    with pytest.raises(TypeError, match="spec is a Spec, a spec file or a built-in spec's name"):
        bind(spec, {"w": torch.zeros(2)})


def test_bind_says_when_model_and_spec_are_swapped() -> None:
    """A model passed first once surfaced as 'File name too long' (its repr taken for a path)."""
    model = torch.nn.Linear(2, 2)
    with pytest.raises(TypeError, match="the other way round"):
        bind(model, "nanogpt")  # type: ignore[arg-type]
