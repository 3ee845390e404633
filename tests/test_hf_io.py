"""Canonicalisation keeps the model's class: a canonicalised, group-transformed Hugging
Face model saves with save_pretrained, reloads with from_pretrained (offline) as the same
class, and computes the same function. The loader reads HF folders, model files with
state dicts, and refuses pickles that are not plain tensors."""

from __future__ import annotations

import os
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch

import symspec
from symspec.binding import bind
from symspec.checker import check
from symspec.errors import ModelLoadError
from symspec.loading import load_model, save_model
from symspec.transforms import apply_elements, canonicalize_model, sample_elements
from tests.zoo import ZOO

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def logits(model: torch.nn.Module, inputs: Any) -> torch.Tensor:
    with torch.no_grad():
        out = model(**inputs) if isinstance(inputs, dict) else model(inputs)
    return out.logits if hasattr(out, "logits") else out


def moved_model(name: str, family: str, seed: int = 3) -> tuple[torch.nn.Module, torch.nn.Module, Any]:
    """(original, canonicalised and moved by a random group element, inputs)."""
    model, inputs = ZOO[family]()
    bound = bind(symspec.load_spec(name), model)
    canon = canonicalize_model(bound, model)
    sd = apply_elements(bound.problem, sample_elements(bound.problem, seed=seed), canon.state_dict())
    canon.load_state_dict(sd)
    return model, canon, inputs


def close(a: torch.Tensor, b: torch.Tensor, rtol: float = 1e-4) -> bool:
    return bool((a - b).abs().max() <= rtol * a.abs().max())


CASES = [("gpt2", "gpt2", "untie"), ("llama", "llama_tied", "untie"), ("opt", "opt", "untie"),
         ("bert", "bert", "tied"), ("llama_tied", "llama_tied", "tied"), ("qwen2", "qwen2", "none"), ("hf_vit", "hf_vit", "none")]


@pytest.mark.parametrize(("name", "family", "tie"), CASES)
def test_transformed_hf_model_round_trips_through_save_pretrained(name: str, family: str, tie: str, tmp_path: Path) -> None:
    model, moved, inputs = moved_model(name, family)
    assert type(moved) is type(model)
    moved.save_pretrained(tmp_path, safe_serialization=True)
    back = type(model).from_pretrained(tmp_path, local_files_only=True).eval()
    assert type(back) is type(model)
    for k, v in moved.state_dict().items():
        assert torch.equal(back.state_dict()[k], v), k
    assert torch.equal(logits(back, inputs), logits(moved, inputs))
    assert close(logits(model, inputs), logits(back, inputs))  # the function survived (float32)
    changed = [k for k, v in back.state_dict().items() if v.shape == model.state_dict()[k].shape and not torch.allclose(v, model.state_dict()[k])]
    assert len(changed) > len(model.state_dict()) // 2
    if tie == "untie":
        head, emb = back.get_output_embeddings().weight, back.get_input_embeddings().weight
        assert head is not emb and not torch.equal(head, emb)
        assert back.config.tie_word_embeddings is False and model.config.tie_word_embeddings is True
    elif tie == "tied":
        assert back.get_output_embeddings().weight is back.get_input_embeddings().weight
        assert back.config.tie_word_embeddings is True


def test_hf_folder_through_symspec_loading(tmp_path: Path) -> None:
    model, moved, inputs = moved_model("gpt2", "gpt2")
    model.save_pretrained(tmp_path / "orig")
    loaded = load_model(tmp_path / "orig")
    assert loaded.format == "hf" and type(loaded.model).__name__ == "GPT2LMHeadModel"
    assert torch.equal(logits(loaded.model, inputs), logits(model, inputs))
    out = save_model(loaded, moved.state_dict(), tmp_path / "moved", model=moved)
    again = load_model(out)
    assert type(again.model) is type(model) and again.model.config.tie_word_embeddings is False
    assert torch.equal(logits(again.model, inputs), logits(moved, inputs))
    with pytest.raises(ModelLoadError, match="exists; refusing to overwrite"):
        save_model(loaded, moved.state_dict(), out, model=moved)
    # default example inputs of an HF folder work with check
    report = check(again.model, symspec.load_spec("gpt2"), again.example_inputs(), samples=1)
    assert report.passed, report.render()


FACTORY = '''
import torch
import transformers

def build():
    cfg = transformers.LlamaConfig(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, hidden_size=16,
                                   intermediate_size=12, vocab_size=23, max_position_embeddings=32, tie_word_embeddings=True,
                                   bos_token_id=0, eos_token_id=0, pad_token_id=None)
    return transformers.LlamaForCausalLM(cfg).eval()

def example_inputs(model, batch=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {"input_ids": torch.randint(23, (batch, 8), generator=g), "use_cache": False}
'''


@pytest.mark.parametrize("suffix", [".pt", ".safetensors"])
def test_state_dict_with_a_factory_restores_the_function_and_unties_what_it_must(suffix: str, tmp_path: Path) -> None:
    factory = tmp_path / "llama_factory.py"
    factory.write_text(FACTORY)
    model, moved, _ = moved_model("llama", "llama_tied")
    loaded = load_model(factory)
    inputs = loaded.example_inputs()
    # the moved checkpoint stores lm_head apart from the embedding: loading unties them
    path = save_model(loaded, moved.state_dict(), tmp_path / f"moved{suffix}")
    back = load_model(path, factory=factory)
    assert back.format == ("safetensors" if suffix == ".safetensors" else "state_dict")
    assert back.model.lm_head.weight is not back.model.model.embed_tokens.weight
    assert back.model.config.tie_word_embeddings is False
    assert torch.equal(logits(back.model, inputs), logits(moved, inputs))
    assert close(logits(model, inputs), logits(back.model, inputs))
    with pytest.raises(ModelLoadError, match="needs the model it belongs to"):
        load_model(path)


class _Exploit:
    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return (os.system, (f"touch {self.marker}",))

    marker = ""


def test_a_pickle_that_is_not_plain_tensors_is_refused(tmp_path: Path) -> None:
    factory = tmp_path / "llama_factory.py"
    factory.write_text(FACTORY)
    marker = tmp_path / "pwned"
    _Exploit.marker = str(marker)
    evil = tmp_path / "evil.pt"
    with evil.open("wb") as f:
        pickle.dump({"model.embed_tokens.weight": _Exploit()}, f)
    with pytest.raises(ModelLoadError, match="weights_only=True"):
        load_model(evil, factory=factory)
    assert not marker.exists()
    # a plain state dict of the wrong model is refused with what does not fit
    other, _ = ZOO["gpt2"]()
    torch.save(other.state_dict(), tmp_path / "gpt2.pt")
    with pytest.raises(ModelLoadError, match="does not fit LlamaForCausalLM"):
        load_model(tmp_path / "gpt2.pt", factory=factory)


@pytest.mark.parametrize(("family", "spec"), [("opt", "opt"), ("bert", "bert"), ("llama", "llama")])
def test_symspec_check_cli_on_an_hf_folder_picks_the_spec_by_class(family: str, spec: str, tmp_path: Path) -> None:
    import json

    from click.testing import CliRunner

    from symspec.cli.main import cli

    model, _ = ZOO[family]()
    model.save_pretrained(tmp_path / family)
    result = CliRunner().invoke(cli, ["check", str(tmp_path / family), "--samples", "1", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["spec"] == spec and report["passed"] is True
    assert {row["dtype"] for row in report["rows"]} == {"float64", "float32"}
    # a too-large group fails through the CLI too (exit 1)
    bad = tmp_path / "bad.yaml"
    bad.write_text((Path(symspec.spec.builtin.builtin_path(spec) or "")).read_text().replace("group: S(", "group: O("))
    result = CliRunner().invoke(cli, ["check", str(tmp_path / family), "--spec", str(bad), "--samples", "1", "--dtype", "float64"])
    assert result.exit_code == 1, result.output
