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


def test_an_endpoint_module_shares_the_working_weights() -> None:
    """share=True: the module's weights are the state's tensors (no second copy of a model),
    and it computes what the owning copy computes; without it the copy owns its weights."""
    model = _model(0)
    bound = symspec.bind("qwen2", model)
    state = symspec.canonicalize_state_dict(bound, {k: v.float() for k, v in model.state_dict().items()})
    before = {k: v.clone() for k, v in state.items()}
    shared = canonical_module(bound, model, state, share=True)
    owned = canonical_module(bound, model, state)
    got_s, got_o = shared.state_dict(), owned.state_dict()
    written = [k for k in state if k in got_s and state[k].is_floating_point()]
    # the head is made anew where canonical form unties it (and then loaded): every layer shares
    assert all(got_s[k].data_ptr() == state[k].data_ptr() for k in written if ".layers." in k)
    assert all(torch.equal(got_s[k], state[k]) for k in written)
    assert all(torch.equal(state[k], before[k]) for k in written)  # building it wrote over nothing
    assert not any(got_o[k].data_ptr() == state[k].data_ptr() for k in written)
    x = torch.randint(VOCAB, (2, 8))
    assert torch.equal(shared(x).logits, owned(x).logits)


def test_a_tied_module_shares_both_twins_once_untied() -> None:
    """An embedding tied to its head that canonical form unties: each of the endpoint
    module's twins is the state's own tensor (no copy: at Qwen2-0.5B two copies of a
    545 MB table per model), and the module computes what an owning copy computes.
    Where the tie stays (``canonical=False``), the module's one tensor is fresh storage:
    one name's tensor for both would be written over by loading the other's."""
    model = ZOO["llama_tied"](seed=0, n_layer=1, vocab=VOCAB)[0] if "llama_tied" in ZOO else None
    if model is None:
        pytest.skip("no tied Llama in the zoo")
    assert model.lm_head.weight is model.model.embed_tokens.weight
    bound = symspec.bind("llama", model)
    state = symspec.canonicalize_state_dict(bound, {k: v.float() for k, v in model.state_dict().items()})
    before = {k: v.clone() for k, v in state.items()}
    shared = canonical_module(bound, model, state, share=True)
    got = shared.state_dict()
    twins = ("model.embed_tokens.weight", "lm_head.weight")
    for k in twins:
        assert got[k].data_ptr() == state[k].data_ptr() and torch.equal(got[k], state[k])
    assert shared.lm_head.weight is not shared.model.embed_tokens.weight
    assert not any(t.is_meta for t in shared.state_dict().values())
    assert all(torch.equal(state[k], before[k]) for k in state)
    x = torch.randint(VOCAB, (2, 8))
    owned = canonical_module(bound, model, state)
    assert not any(owned.state_dict()[k].data_ptr() == state[k].data_ptr() for k in twins)
    assert torch.equal(shared(x).logits, owned(x).logits)
    raw = {k: v.float() for k, v in model.state_dict().items()}
    kept = canonical_module(bound, model, raw, canonical=False, share=True)
    assert kept.lm_head.weight is kept.model.embed_tokens.weight
    assert kept.lm_head.weight.data_ptr() != raw["lm_head.weight"].data_ptr()
    assert torch.equal(kept.lm_head.weight, raw["lm_head.weight"])
