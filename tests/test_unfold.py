"""Unfolding norms (``match``/``merge --unfold-norms``, :func:`symspec.transforms.unfold_norms`).

Aligned and merged models are written in canonical form: norm gains folded into the
layers that read them, LayerNorm biases into their biases. Compared with A's raw weights
that looks like a failed recovery (norm gains 1 against A's), although it is exact.
Unfolding with A's gains gives the raw form back: on a planted pair B = g·A, aligned B
unfolded equals A's raw weights on every tensor a fold touched; for any pair it keeps the
function (checked in float64), and an inconsistent unfolding is caught by that check."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import torch

import symspec
from symspec.canonical import CanonOp
from symspec.checker import call_forward, compare, flatten_outputs
from symspec.precision import KeepFloat64
from symspec.transforms import canonicalize_state_dict, unfold_norms
from tests.cli_files import model_file, run, write_words
from tests.needs import optional
from tests.zoo import ZOO

#: relative float64 tolerance on outputs (the checker's)
RTOL = 1e-9


def build(name: str, seed: int = 0) -> tuple[torch.nn.Module, Any]:
    if name != "nanogpt":
        optional("transformers")
    model, inputs = ZOO[name](seed=seed)
    return model.double().eval(), inputs


def raw(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach() for k, v in model.state_dict().items()}


def outputs(module: torch.nn.Module, sd: dict[str, torch.Tensor], inputs: Any) -> list[torch.Tensor]:
    m = copy.deepcopy(module).double().eval()
    m.load_state_dict({k: v.double() if v.is_floating_point() else v for k, v in sd.items()}, strict=False)
    with torch.no_grad(), KeepFloat64():
        return flatten_outputs(call_forward(m, inputs))


def relative_difference(module: torch.nn.Module, a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], inputs: Any) -> float:
    return compare(outputs(module, a, inputs), outputs(module, b, inputs))[1]


def folded_names(bound: Any) -> set[str]:
    """Every tensor a fold_norm step rewrites: gains, norm biases, readers and their biases."""
    names: set[str] = set()
    for op in bound.canonical:
        if op.kind == "fold_norm":
            names |= {n for n in (op.args["gain"], op.args.get("bias")) if n}
            names |= {n for r in op.args["into"] for n in (r["weight"], r.get("bias")) if n}
    return names


def gains(bound: Any) -> list[str]:
    return [op.args["gain"] for op in bound.canonical if op.kind == "fold_norm"]


@pytest.fixture(scope="module", params=["nanogpt", "gpt2", "llama"])
def planted(request: pytest.FixtureRequest) -> dict[str, Any]:
    """A, B = g·A (planted: B is in canonical form, its norm gains 1), and B aligned to A."""
    name = request.param
    a, inputs = build(name)
    b = symspec.plant(a, name, seed=3).model
    res = symspec.align(a, b, name, rounds=30, tol=1e-12)
    return {"name": name, "a": a, "b": b, "inputs": inputs, "res": res}


def test_planted_pair_unfolded_equals_as_raw_weights(planted: dict[str, Any]) -> None:
    a, res = planted["a"], planted["res"]
    ra = raw(a)
    u = unfold_norms(res.bound, res.aligned_b, ra)
    assert u.unfolded == gains(res.bound) and u.unfolded  # every norm, in the spec's order
    names = folded_names(res.bound)
    for n in names:
        scale = float(ra[n].abs().max())
        assert float((u.state_dict[n] - ra[n]).abs().max()) <= 1e-8 * max(scale, 1.0), n
    # the control: folded, the same recovery looks like a failure on the norm gains
    worst = max(float((res.aligned_b[g] - ra[g]).abs().max()) for g in gains(res.bound))
    assert worst > 0.05
    # LayerNorm biases (GPT-2, nanoGPT) are A's again, out of the readers' biases
    biases = [op.args["bias"] for op in res.bound.canonical if op.kind == "fold_norm" and op.args.get("bias")]
    assert (planted["name"] == "llama") == (not biases)
    assert all(torch.allclose(u.state_dict[n], ra[n], atol=1e-8) for n in biases)


def test_unfolded_output_keeps_the_function_and_a_wrong_unfolding_is_caught(planted: dict[str, Any]) -> None:
    a, res, inputs = planted["a"], planted["res"], planted["inputs"]
    module = res.canonical_model
    u = unfold_norms(res.bound, res.aligned_b, raw(a))
    assert relative_difference(module, res.aligned_b, u.state_dict, inputs) < RTOL
    # any gains without zeros keep it: unfold with another model's
    other, _ = build(planted["name"], seed=5)
    v = unfold_norms(res.bound, res.aligned_b, raw(other))
    assert relative_difference(module, res.aligned_b, v.state_dict, inputs) < RTOL
    assert not torch.equal(v.state_dict[gains(res.bound)[0]], u.state_dict[gains(res.bound)[0]])
    # the negative case: the readers divided by A's gains but the norm given other ones
    wrong = dict(u.state_dict)
    g = gains(res.bound)[0]
    wrong[g] = v.state_dict[g]
    assert relative_difference(module, res.aligned_b, wrong, inputs) > 1e-4


def test_unfolding_a_merge_keeps_its_function() -> None:
    a, inputs = build("nanogpt")
    b, _ = build("nanogpt", seed=1)  # independently drawn: nothing to recover, the function is what counts
    res = symspec.align(a, b, "nanogpt", rounds=3)
    merged = res.interpolate(0.5)
    u = unfold_norms(res.bound, merged, raw(a))
    assert relative_difference(res.canonical_model, merged, u.state_dict, inputs) < RTOL
    assert all(torch.equal(u.state_dict[g], raw(a)[g]) for g in u.unfolded)


def test_a_zero_gain_leaves_that_norm_folded_with_a_note() -> None:
    a, inputs = build("nanogpt")
    res = symspec.align(a, symspec.plant(a, "nanogpt", seed=1).model, "nanogpt", rounds=2)
    ra = raw(a)
    g = "transformer.h.0.ln_2.weight"
    ra[g] = ra[g].clone()
    ra[g][3] = 0.0
    u = unfold_norms(res.bound, res.aligned_b, ra)
    assert g not in u.unfolded and len(u.unfolded) == len(gains(res.bound)) - 1
    assert any(n.startswith(f"{g}: the reference's gain has zero entries") and "stays folded" in n for n in u.notes), u.notes
    assert torch.equal(u.state_dict[g], res.aligned_b[g])  # still folded: gain 1
    assert relative_difference(res.canonical_model, res.aligned_b, u.state_dict, inputs) < RTOL


def test_a_spec_without_folds_and_a_kept_tie_say_so() -> None:
    op = CanonOp("fold_norm", {"gain": "g", "bias": None, "into": [{"weight": "w", "axis": 1, "bias": None}]})

    class Bound:
        canonical = (op,)

    class NoFolds:
        canonical: tuple[CanonOp, ...] = ()

    sd = {"g": torch.tensor([2.0, 0.5]), "w": torch.ones(3, 2)}
    u = unfold_norms(NoFolds(), sd, sd)
    assert u.unfolded == [] and u.notes == ["the spec folds no norm (no fold_norm step): nothing to unfold"]
    assert u.state_dict == sd
    folded = canonicalize_state_dict(Bound(), sd)
    back = unfold_norms(Bound(), folded, sd)
    assert back.notes == [] and all(torch.equal(back.state_dict[k], sd[k]) for k in sd)
    # the nanoGPT spec unties its head to fold ln_f into it: that stays, and is said
    a, _ = build("nanogpt")
    res = symspec.align(a, symspec.plant(a, "nanogpt", seed=1).model, "nanogpt", rounds=1)
    notes = unfold_norms(res.bound, res.aligned_b, raw(a)).notes
    assert notes == [n for n in notes if n.startswith("lm_head.weight stays untied from transformer.wte.weight")] and notes


def test_an_unfolding_that_would_overflow_in_float16_stays_folded() -> None:
    op = CanonOp("fold_norm", {"gain": "g", "bias": None, "into": [{"weight": "w", "axis": 1, "bias": None}]})

    class Bound:
        canonical = (op,)

    folded = {"g": torch.ones(2, dtype=torch.float16), "w": torch.full((3, 2), 100.0, dtype=torch.float16)}
    tiny = {"g": torch.tensor([1e-3, 1.0], dtype=torch.float16), "w": folded["w"]}
    u = unfold_norms(Bound(), folded, tiny)
    assert u.notes == ["g: unfolding it makes w overflow in float16; this norm stays folded"] and u.unfolded == []
    assert all(torch.equal(u.state_dict[k], folded[k]) for k in folded)
    fine = unfold_norms(Bound(), folded, {"g": torch.tensor([0.5, 2.0], dtype=torch.float16)})  # the control
    assert fine.unfolded == ["g"] and fine.state_dict["w"][0].tolist() == [200.0, 50.0]


# -- the command line ---------------------------------------------------------------------------

PLANTED_B = '''
import symspec
from symspec.loading import import_file

_a = import_file({a!r})
SPEC = "nanogpt"


def build():
    return symspec.plant(_a.build(), "nanogpt", seed=2).model


example_inputs = _a.example_inputs
'''


RANDOM_NORMS = """
_b = build


def build(**kw):
    from symspec.testing import randomize_

    return randomize_(_b(**kw), 0)
"""


@pytest.fixture(scope="module")
def model_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("unfold")
    vocab = write_words(d / "words.txt")
    # random norm gains and biases (a fresh model's are 1 and 0: folding them changes nothing)
    a = model_file(d, "a.py", vocab, extra=RANDOM_NORMS)
    b = d / "b.py"
    b.write_text(PLANTED_B.format(a=str(a)))
    return {"a": a, "b": b}


@pytest.mark.parametrize("unfold", [True, False])
def test_match_unfold_norms_writes_as_norm_gains(model_files: dict[str, Path], tmp_path: Path, unfold: bool,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    from symspec.loading import load_model

    monkeypatch.chdir(tmp_path)
    flag = ["--unfold-norms"] if unfold else []
    code, out, err = run("match", model_files["a"], model_files["b"], "--out", "out", "--rounds", "20", "--tol", "0",
                         "--json", *flag)
    assert code == 0, (out, err)
    summary = json.loads(out)
    written = torch.load(tmp_path / "out" / "model.pt", weights_only=True)
    ra = raw(load_model(model_files["a"]).model)
    names = ["transformer.h.0.ln_1.weight", "transformer.h.0.ln_1.bias", "transformer.ln_f.weight",
             "transformer.h.0.mlp.c_fc.weight", "transformer.h.0.mlp.c_fc.bias"]
    err_max = max(float((written[n] - ra[n]).abs().max()) for n in names)
    if unfold:
        assert err_max < 1e-4, err_max
        assert summary["unfold_norms"]["unfolded"] == ["transformer.h.0.ln_1.weight", "transformer.h.0.ln_2.weight",
                                                       "transformer.ln_f.weight"]
        assert "note: --unfold-norms: lm_head.weight stays untied" in err
    else:  # the control: canonical form, the norm gains are 1
        assert err_max > 0.05 and "unfold_norms" not in summary
        assert torch.equal(written["transformer.ln_f.weight"], torch.ones_like(ra["transformer.ln_f.weight"]))


def test_merge_unfold_norms(model_files: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    code, out, err = run("merge", model_files["a"], model_files["b"], "--out", "m", "--rounds", "2", "--unfold-norms", "--json")
    assert code == 0, (out, err)
    assert len(json.loads(out)["unfold_norms"]["unfolded"]) == 3
    code, out, err = run("merge", model_files["a"], model_files["b"], "--out", "n", "--no-align", "--unfold-norms")
    assert code == 0, (out, err)
    assert "note: --unfold-norms: the method 'none' works on the raw weights: no norm was folded, nothing to unfold" in err
