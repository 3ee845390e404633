"""Data-driven alignment of bfloat16 models: the module that records activations holds
the float32 working weights, never a bfloat16 copy of them (which would round them, and
whose traced graph casts activations back to bfloat16 and fails against float32 weights)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import symspec
from symspec.alignment.result import canonical_module
from tests.cli_files import WORDS, run, write_words
from tests.zoo import ZOO

transformers = pytest.importorskip("transformers")

VOCAB = len(set(" ".join(WORDS) + ".\n"))


def _model(seed: int) -> torch.nn.Module:
    return ZOO["qwen2"](seed=seed, n_layer=2, vocab=VOCAB)[0].to(torch.bfloat16)


def test_canonical_module_keeps_the_working_dtype() -> None:
    model = _model(0)
    bound = symspec.bind("qwen2", model)
    state = symspec.canonicalize_state_dict(bound, {k: v.float() for k, v in model.state_dict().items()})
    out = canonical_module(bound, model, state)
    got = out.state_dict()
    written = [k for k in state if k in got]
    assert written and all(got[k].dtype == torch.float32 for k in written)
    # the values are the float32 ones, not rounded to bfloat16: a folded norm gain makes them
    # differ from any bfloat16 value somewhere
    assert all(torch.equal(got[k], state[k]) for k in written)
    assert any(not torch.equal(state[k], state[k].bfloat16().float()) for k in written)
    assert model.model.layers[0].mlp.up_proj.weight.dtype == torch.bfloat16  # the caller's module untouched


@pytest.mark.parametrize("method", ["weight+activation", "activation"])
def test_data_methods_on_bf16_folders(tmp_path: Path, method: str) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    _model(0).save_pretrained(a)
    _model(1).save_pretrained(b)
    text = tmp_path / "words.txt"
    write_words(text)
    code, _, err = run("match", str(a), str(b), "--method", method, "--data", f"text:{text},block=16",
                         "--rounds", "2", "--out", str(tmp_path / "o"))
    assert code == 0, err
    aligned = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "o")
    assert aligned.model.layers[0].mlp.up_proj.weight.dtype == torch.bfloat16
    # negative control: the same command on a folder of another architecture fails cleanly
    code, _, err = run("match", str(a), str(tmp_path / "missing"), "--method", method, "--data",
                       f"text:{text},block=16", "--out", str(tmp_path / "o2"))
    assert code == 2 and err.startswith("error:")
