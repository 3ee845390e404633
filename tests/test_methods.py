"""The alignment registry is the only seam: a toy method registered from a test is offered
by symspec.align, ``symspec match --method``, ``merge --method``, ``barrier --align``,
``symspec methods`` and universe matching, with no other change; unregistered, it is
refused everywhere."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import symspec
from symspec.alignment import (
    Alignment,
    AlignOptions,
    Endpoint,
    get_method,
    method_names,
    register_method,
    registered,
    unregister_method,
)
from symspec.alignment.builtin import WeightMatching
from symspec.errors import SymspecInputError
from symspec.transforms import canonicalize_state_dict
from tests.cli_files import model_file, run, write_words
from tests.methods import Identity
from tests.zoo import ZOO


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("methods")
    text = d / "words.txt"
    vocab = write_words(text)
    mf = model_file(d, "gpt.py", vocab)
    from symspec.loading import load_model

    cls = type(load_model(mf).model)
    cfg = load_model(mf).model.config
    out = {"dir": d, "text": text, "model": mf}
    for i in range(2):
        torch.manual_seed(i)
        out[f"m{i}"] = d / f"m{i}.pt"
        torch.save(cls(cfg).state_dict(), out[f"m{i}"])
    return out


def test_the_built_in_methods_are_registered_with_their_labels() -> None:
    assert method_names()[:3] == ["none", "weight", "weight-perm"]
    assert get_method("weight-perm").groups == "perm" and not get_method("none").canonical
    with pytest.raises(SymspecInputError, match="unknown alignment method 'wieght'; did you mean 'weight'"):
        get_method("wieght")


def test_registering_refuses_a_taken_name_and_a_non_method() -> None:
    with pytest.raises(ValueError, match="already registered"):
        register_method(WeightMatching(label="another"))
    with pytest.raises(TypeError, match="does not implement"):
        register_method(object())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="method names"):
        register_method(Identity(name="two words"))
    assert get_method("weight").label == "weight matching"  # untouched


def test_a_toy_method_runs_in_the_common_pipeline() -> None:
    a, _ = ZOO["nanogpt"](seed=0)
    b, _ = ZOO["nanogpt"](seed=1)
    toy = Identity()
    with registered(toy):
        res = symspec.align(a, b, "nanogpt", method="identity")
    assert len(toy.calls) == 1 and "resid" in toy.calls[0]  # called once, on the bound problem
    assert res.method == "identity" and res.record.meta["method"] == "identity" and res.info == {"toy": True}
    # identity elements: B is its canonical form, nothing else
    assert all(torch.equal(res.aligned_b[k], res.canonical_b[k]) for k in res.aligned_b)  # type: ignore[index]
    assert res.distance("aligned") == pytest.approx(res.distance("canonical"))
    # the same pair with weight matching does move B (the check can fail)
    moved = symspec.align(a, b, "nanogpt", method="weight", rounds=2)
    assert moved.distance("aligned") < 0.9 * moved.distance("canonical")
    assert "identity" not in method_names()


def test_a_method_that_needs_data_says_so() -> None:
    a, _ = ZOO["nanogpt"](seed=0)
    with registered(Identity(name="needs-data", needs_data=True)), pytest.raises(SymspecInputError, match="needs data"):
        symspec.align(a, a, "nanogpt", method="needs-data")


def test_the_cli_offers_a_registered_method_and_refuses_it_once_withdrawn(files: dict[str, Path], tmp_path: Path) -> None:
    args = [files["m0"], files["m1"], "--model", files["model"]]
    with registered(Identity()):
        code, out, err = run("methods", "--json")
        assert code == 0 and "identity" in [m["name"] for m in json.loads(out)]
        tried = {m["name"] for m in json.loads(out) if m["candidate"]}
        # auto's candidates (and any a benchmark module imported here registered), not identity
        assert {"weight", "weight-tokens", "activation", "weight+activation"} <= tried and "identity" not in tried
        assert not tried & {"none", "weight-perm", "learned", "universe", "auto"}
        code, out, err = run("match", *args, "--method", "identity", "--out", tmp_path / "m", "--json")
        assert code == 0, err
        summary = json.loads(out)
        assert summary["method"] == "identity"
        assert json.loads((tmp_path / "m" / "transform.json").read_text())["meta"]["method"] == "identity"
        code, out, err = run("merge", *args, "--method", "identity", "--out", tmp_path / "g", "--json")
        assert code == 0 and json.loads(out)["method"] == "identity", err
        code, out, err = run("barrier", files["m0"], files["m1"], "--model", files["model"], "--data",
                             f"text:{files['text']}", "--points", "3", "--align", "none", "--align", "identity", "--json")
        assert code == 0, err
        doc = json.loads(out)
        assert [m["method"] for m in doc["methods"]] == ["none", "identity"]
        assert doc["methods"][1]["label"] == "identity (test)"
    code, _, err = run("match", *args, "--method", "identity", "--out", tmp_path / "n")
    assert code == 2 and "unknown alignment method 'identity'" in err and not (tmp_path / "n").exists()
    code, _, err = run("barrier", files["m0"], files["m1"], "--model", files["model"], "--align", "identity")
    assert code == 2 and "unknown alignment method 'identity'" in err


def test_universe_matching_rounds_use_a_registered_method(files: dict[str, Path]) -> None:
    from symspec.universe import universe_match

    models = [ZOO["nanogpt"](seed=s)[0] for s in range(3)]
    toy = Identity()
    with registered(toy):
        res = universe_match(models, "nanogpt", method="identity", rounds=2, jobs=1)
    # every round aligned every model with it (worker processes are not used with jobs=1)
    assert len(toy.calls) >= 3
    # identity alignment: the universe is the plain average of the canonical forms
    bound = res.bound
    canon = [canonicalize_state_dict(bound, m.state_dict()) for m in models]
    for k, u in res.merged.items():
        mean = sum(c[k].double() for c in canon) / len(canon)
        torch.testing.assert_close(u.double(), mean, rtol=1e-6, atol=1e-6)
    # negative case: a real alignment moves the universe away from the plain average
    moved = universe_match(models, "nanogpt", method="weight", rounds=2, jobs=1)
    assert any(not torch.allclose(moved.merged[k].double(), sum(c[k].double() for c in canon) / 3, atol=1e-4)
               for k in moved.merged)


def test_unregister_is_idempotent() -> None:
    unregister_method("never-registered")
    assert "never-registered" not in method_names()


def test_alignment_options_and_endpoint_are_plain_values() -> None:
    o = AlignOptions(rounds=3)
    assert o.rounds == 3 and o.tol == 1e-6 and o.tuning is None and not o.consume_b
    e = Endpoint({"w": torch.zeros(1)})
    assert e.module is None
    assert Alignment({}, [1.0]).converged
