"""symspec.plant: B = g·A as a model of A's own class, for every built-in spec, untied
where the spec unties (the README's example of planting)."""

from __future__ import annotations

import copy

import pytest
import torch

import symspec
from symspec.data import call_model, logits_of
from symspec.spec.builtin import builtin_names
from symspec.transforms import apply_elements, canonicalize_state_dict
from tests.zoo import ZOO


def _out(model: torch.nn.Module, inputs: object) -> torch.Tensor:
    with torch.no_grad():
        return logits_of(call_model(model, inputs)).double()


def _rel(x: torch.Tensor, y: torch.Tensor) -> float:
    return float((x - y).abs().max() / y.abs().max())


@pytest.mark.parametrize("name", builtin_names())
def test_planted_copy_computes_a_with_other_weights_in_a_s_class(name: str) -> None:
    model, inputs = ZOO[name]()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    planted = symspec.plant(model, name, seed=3)
    b = planted.model
    assert type(b) is type(model)
    assert _rel(_out(b, inputs), _out(model, inputs)) < 1e-4
    moved = [k for k, v in b.state_dict().items() if v.is_floating_point() and not torch.allclose(v, planted.canonical.state_dict()[k])]
    assert moved, "the planted element moved no weight"
    assert all(v.dtype == before[k].dtype for k, v in b.state_dict().items())
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items()), "plant modified its input"


def test_untied_head_is_untied_in_the_planted_module_and_a_state_dict_load_is_not_enough() -> None:
    # nanogpt ties lm_head to the token embedding and its spec unties it
    model, inputs = ZOO["nanogpt"]()
    assert model.lm_head.weight is model.transformer.wte.weight
    planted = symspec.plant(model, "nanogpt", seed=0)
    assert planted.model.lm_head.weight is not planted.model.transformer.wte.weight
    assert _rel(_out(planted.model, inputs), _out(model, inputs)) < 1e-4
    # the negative case: the same element applied to the state dict and loaded into the
    # (still tied) module writes one side over the other; B then computes something else
    bound = symspec.bind(symspec.load_spec("nanogpt"), model)
    sd = canonicalize_state_dict(bound, {k: v.detach() for k, v in model.state_dict().items()})
    naive = copy.deepcopy(model)
    naive.load_state_dict(apply_elements(bound.problem, planted.elements, {k: v.double() for k, v in sd.items()}))
    assert _rel(_out(naive, inputs), _out(model, inputs)) > 1e-2


def test_planted_copy_is_seeded_and_restricted_to_the_named_spaces() -> None:
    model, _ = ZOO["gpt2"]()
    one = symspec.plant(model, "gpt2", seed=5)
    two = symspec.plant(model, "gpt2", seed=5)
    assert all(torch.equal(v, two.model.state_dict()[k]) for k, v in one.model.state_dict().items())
    only = symspec.plant(model, "gpt2", seed=5, spaces=["resid"])
    assert set(only.elements) == {"resid"}
