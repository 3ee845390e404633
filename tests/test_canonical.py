"""Canonicalisation steps: one class per kind, used by loading, the schema, binding, the
transforms and the checker alike."""

from __future__ import annotations

import subprocess
import sys

import jsonschema
import pytest
import torch

import symspec
from symspec.binding import bind
from symspec.canonical import STEPS, CanonOp, Untie, register
from symspec.checker import canonicalize_inplace, copy_as
from symspec.spec.schema import json_schema
from symspec.spec.steps import STEP_KINDS
from symspec.transforms import canonicalize_model, canonicalize_state_dict
from symspec.transforms.canonicalize import canonicalize_structure
from tests.zoo import ZOO


def test_each_step_kind_describes_itself_in_the_schema() -> None:
    assert list(STEPS) == ["untie", "fold_norm", "center"]
    items = json_schema()["properties"]["canonicalize"]["items"]["oneOf"]
    assert items == [step.syntax.json_schema() for step in STEPS.values()]
    jsonschema.validate({"untie": "lm_head.weight"}, STEPS["untie"].syntax.json_schema())  # the shorthand
    jsonschema.validate({"center": {"writers": {"wte.weight": 1}}}, STEPS["center"].syntax.json_schema())


def test_every_declared_step_kind_has_one_implementation() -> None:
    """The spec language declares the kinds' syntax; canonical implements each, and only those."""
    assert list(STEP_KINDS) == list(STEPS)
    assert all(impl.syntax is STEP_KINDS[kind] and impl.kind == kind for kind, impl in STEPS.items())


def test_an_undeclared_step_kind_cannot_be_implemented() -> None:
    class Squash(Untie):
        kind = "squash"

    with pytest.raises(ValueError, match="'squash' is not declared"):
        register(Squash)
    assert "squash" not in STEPS
    register(Untie)  # a declared kind registers (again, in place)
    assert list(STEPS) == ["untie", "fold_norm", "center"]


def test_reading_a_spec_does_not_import_the_implementations() -> None:
    code = ("import sys; from symspec.spec import load_spec; from symspec.spec.schema import json_schema; "
            "load_spec('specs/gpt2.yaml'); json_schema(); print('symspec.canonical' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
    out = subprocess.run([sys.executable, "-c", code.replace("load_spec('specs/gpt2.yaml'); ", "import symspec.canonical; ")],
                         capture_output=True, text=True, check=True).stdout
    assert out.strip() == "True"  # the positive control: the probe sees the package when it is imported


def test_bound_ops_are_applied_by_their_kind() -> None:
    model, _ = ZOO["nanogpt"]()
    bound = bind(symspec.load_spec("nanogpt"), model)
    assert [op.kind for op in bound.canonical][:1] == ["untie"]
    assert all(op.impl is STEPS[op.kind] for op in bound.canonical)
    state = {k: v.detach() for k, v in model.state_dict().items()}
    by_hand = dict(state)
    for op in bound.canonical:
        op.impl.apply(op, by_hand)
    canonical = canonicalize_state_dict(bound, state)
    assert all(torch.equal(canonical[k], by_hand[k]) for k in canonical)
    assert model.lm_head.weight is model.transformer.wte.weight  # the input is left alone


def test_structure_and_values_make_the_canonical_model() -> None:
    model, inputs = ZOO["nanogpt"]()
    model = model.double()
    bound = bind(symspec.load_spec("nanogpt"), model)
    untied = copy_as(model, torch.float64)
    canonicalize_structure(bound, untied)
    assert untied.lm_head.weight is not untied.transformer.wte.weight
    assert torch.equal(untied.lm_head.weight, untied.transformer.wte.weight)  # values as they were
    in_place = copy_as(model, torch.float64)
    canonicalize_inplace(bound, in_place)
    copied = canonicalize_model(bound, model)
    assert all(torch.equal(a, b) for a, b in zip(in_place.state_dict().values(), copied.state_dict().values()))
    with torch.no_grad():
        y, y_canon = model(*inputs), copied(*inputs)
    assert float((y - y_canon).abs().max()) <= 1e-9 * float(y.abs().max())


def test_center_applies_one_writer_at_a_time_with_the_same_result() -> None:
    sd = {"a": torch.randn(3, 4, dtype=torch.float64), "b": torch.randn(4, dtype=torch.float64)}
    op = CanonOp("center", {"writers": [{"param": "a", "axis": 1}, {"param": "b", "axis": 0}]})
    whole, pieces = dict(sd), dict(sd)
    op.impl.apply(op, whole)
    assert len(op.impl.pieces(op)) == 2
    for piece in op.impl.pieces(op):
        piece.impl.apply(piece, pieces)
    assert all(torch.equal(whole[k], pieces[k]) for k in sd)
    assert float(whole["a"].mean(1).abs().max()) < 1e-12


def test_a_fold_knows_its_other_reading() -> None:
    op = CanonOp("fold_norm", {"gain": "g", "bias": None, "fold_bias": True, "into": [{"weight": "w", "axis": 1, "bias": None}]})
    alternative = op.impl.alternative(op)
    assert alternative is not None
    other, told = alternative
    assert other.args["gain_offset"] == 1 and "(1 + weight)" in told
    back, told_back = other.impl.alternative(other)  # type: ignore[misc]
    assert back.args["gain_offset"] == 0 and told_back.startswith("without gain_offset")
    sd = {"g": torch.tensor([2.0, 3.0]), "w": torch.ones(1, 2)}
    other.impl.apply(other, sd)  # multiplies by (1 + g)
    assert sd["w"].tolist() == [[3.0, 4.0]] and sd["g"].tolist() == [0.0, 0.0]


def test_the_transforms_do_not_import_the_binding() -> None:
    code = "import sys, symspec.transforms; print('symspec.binding' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
