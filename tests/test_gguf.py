"""GGUF files (llama.cpp's format) as model sources (issue 28): a tiny Llama written as
GGUF here, offline, with the gguf package's writer in the layout llama.cpp's converter
uses (its tensor names, q/k rows in llama.cpp's rotary order), loads as the model it was
written from, dequantised; check, match and merge take it; results are written as a
Hugging Face folder that loads again. Bad files are one error line each."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from symspec.errors import ModelLoadError
from symspec.loading import load_model
from tests.cli_files import run
from tests.needs import optional

gguf = optional("gguf")
transformers = optional("transformers")
optional("accelerate")

HEADS, KV_HEADS = 2, 1


def tiny_llama(seed: int = 0) -> Any:
    """A two-layer Llama of width 16 (grouped-query attention, untied head); the MLP is
    32 wide so that its down projection's rows fill whole Q8_0 blocks."""
    cfg = transformers.LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                   num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=64,
                                   tie_word_embeddings=False, bos_token_id=0, eos_token_id=0, pad_token_id=None)
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # norm gains away from 1, so that folding them is seen
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return model


def _rotary_order(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter reorders q/k rows per head (interleaved rotary pairs);
    transformers' GGUF loader undoes it."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(model: Any, path: Path, types: dict[str, str] | None = None, arch: str = "llama",
               shards: int = 1) -> Path:
    """``model`` (a LlamaForCausalLM) as a GGUF file; ``types``: a tensor type other than
    F32 ("F16", "Q8_0") for the GGUF tensors whose names contain a key; ``shards`` > 1:
    marked as the first of that many files (llama.cpp's split GGUF)."""
    cfg = model.config
    w = gguf.GGUFWriter(str(path), arch)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_embedding_length(cfg.hidden_size)
    w.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    w.add_rope_freq_base(float(cfg.rope_parameters["rope_theta"]))
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    if shards > 1:
        w.add_uint16("split.count", shards)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, cfg.num_hidden_layers)
    for key, value in model.state_dict().items():
        stem, suffix = key.rsplit(".", 1)
        name = f"{names.get_name(stem)}.{suffix}"
        a = value.detach().float().numpy()
        if ".attn_q." in name:
            a = _rotary_order(a, cfg.num_attention_heads)
        elif ".attn_k." in name:
            a = _rotary_order(a, cfg.num_key_value_heads)
        kind = next((t for k, t in (types or {}).items() if k in name), "F32")
        if kind == "F16":
            w.add_tensor(name, a.astype(np.float16))
        elif kind == "Q8_0":
            q8 = gguf.GGMLQuantizationType.Q8_0
            w.add_tensor(name, gguf.quants.quantize(a, q8), raw_dtype=q8)
        else:
            w.add_tensor(name, a.astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def logits(model: Any, seed: int = 0) -> torch.Tensor:
    ids = torch.randint(32, (2, 8), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        return model(input_ids=ids, use_cache=False).logits


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A as GGUF, and B = g·A (A's canonical form with its MLP neurons permuted) as GGUF."""
    import symspec

    d = tmp_path_factory.mktemp("gguf")
    a = tiny_llama()
    planted = symspec.plant(a, "llama", seed=3, spaces=["mlp[0]", "mlp[1]"])
    return {"dir": d, "a": a, "b": planted.model, "canonical": planted.canonical,
            "a_path": write_gguf(a, d / "a.gguf"), "b_path": write_gguf(planted.model, d / "b.gguf")}


def test_a_gguf_file_loads_as_the_model_it_was_written_from(pair: dict[str, Any]) -> None:
    loaded = load_model(pair["a_path"])
    assert loaded.format == "hf" and type(loaded.model).__name__ == "LlamaForCausalLM"
    assert "GGUF" in loaded.note and "float32" in loaded.note and "Hugging Face folder" in loaded.note
    own = pair["a"].state_dict()
    got = loaded.model.state_dict()
    assert set(got) == set(own)
    assert all(torch.equal(got[k], v) for k, v in own.items())  # F32: exact, q/k rows back in order
    assert torch.equal(logits(loaded.model), logits(pair["a"]))
    # nothing says "quantised" any more: the model saves like any Hugging Face model
    assert getattr(loaded.model.config, "quantization_config", None) is None
    assert getattr(loaded.model, "hf_quantizer", None) is None


def test_the_config_matches_the_hugging_face_original(pair: dict[str, Any]) -> None:
    from symspec.loading import config_differences

    # GGUF stores the norm epsilon as float32: 1e-6 reads back as 9.99999997e-07 ...
    raw = gguf.GGUFReader(str(pair["a_path"])).fields["llama.attention.layer_norm_rms_epsilon"].contents()
    assert raw != pair["a"].config.rms_norm_eps
    # ... and is read as the decimal it was: no "different configs" against the original
    loaded = load_model(pair["a_path"])
    assert loaded.model.config.rms_norm_eps == pair["a"].config.rms_norm_eps
    assert config_differences(loaded, pair["a"]) == {}


def test_the_python_api_dequantises_to_the_dtype_asked_for(pair: dict[str, Any]) -> None:
    from symspec.loading.gguf import load_gguf

    loaded = load_gguf(pair["a_path"], dtype=torch.float64)
    assert {v.dtype for v in loaded.model.state_dict().values()} == {torch.float64}
    assert "dequantised to float64" in loaded.note
    assert torch.allclose(logits(loaded.model), logits(pair["a"]).double(), atol=1e-5)


def test_f16_and_q8_0_tensors_are_dequantised_to_float32(pair: dict[str, Any]) -> None:
    path = write_gguf(pair["a"], pair["dir"] / "mixed.gguf", {"token_embd": "F16", "ffn_down": "Q8_0"})
    loaded = load_model(path)
    assert "F16" in loaded.note and "Q8_0" in loaded.note
    got, own = loaded.model.state_dict(), pair["a"].state_dict()
    assert {v.dtype for v in got.values()} == {torch.float32}
    down = "model.layers.0.mlp.down_proj.weight"
    emb = "model.embed_tokens.weight"
    # Q8_0 keeps 8 bits per value (scale per 32): close, not equal; F16 within its rounding
    assert not torch.equal(got[down], own[down])
    assert torch.allclose(got[down], own[down], atol=float(own[down].abs().max()) / 100)
    assert torch.allclose(got[emb], own[emb], rtol=1e-3, atol=1e-6)
    assert torch.equal(got["model.layers.0.self_attn.q_proj.weight"], own["model.layers.0.self_attn.q_proj.weight"])


def test_symspec_check_passes_on_a_gguf_file(pair: dict[str, Any]) -> None:
    code, out, err = run("check", pair["a_path"], "--samples", "1", "--json")
    assert code == 0, err
    report = json.loads(out)
    assert report["spec"] == "llama" and report["passed"] is True


def test_match_recovers_a_planted_permutation_and_writes_a_folder_that_loads(pair: dict[str, Any]) -> None:
    out = pair["dir"] / "matched"
    code, stdout, err = run("match", pair["a_path"], pair["b_path"], "--out", out, "--json")
    assert code == 0, err
    summary = json.loads(stdout)
    # B differs from A before (a negative control) and is A again after
    assert summary["distance"]["canonical"] > 1.0
    assert summary["distance"]["aligned"] < 1e-4
    # B came from GGUF: it is written as a Hugging Face folder, the record beside it
    assert {"config.json", "model.safetensors", "transform.json", "match.json"} <= set(summary["files"])
    # and says so: how each input was read, with the format it is written in
    assert len(summary["notes"]) == 2 and all("dequantised to float32" in n and "Hugging Face folder" in n
                                              for n in summary["notes"]), summary.get("notes")
    code, stdout, err = run("match", pair["a_path"], pair["b_path"], "--out", out, "--force")
    assert code == 0 and stdout.count("note: ") == 2 and "read from GGUF" in stdout, (stdout, err)
    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in config and config["architectures"] == ["LlamaForCausalLM"]
    back = load_model(out)
    assert back.format == "hf" and back.note is None
    canonical = pair["canonical"].state_dict()
    assert all(torch.allclose(v, canonical[k], atol=1e-5) for k, v in back.model.state_dict().items())
    assert torch.allclose(logits(back.model), logits(pair["a"]), atol=1e-4)  # B's function, which is A's


def test_merge_of_two_gguf_files_writes_a_folder_that_loads(pair: dict[str, Any]) -> None:
    out = pair["dir"] / "merged"
    code, _, err = run("merge", pair["a_path"], pair["b_path"], "--out", out, "--json")
    assert code == 0, err
    merged = load_model(out)
    # A and g·A aligned and averaged: A's function again
    assert torch.allclose(logits(merged.model), logits(pair["a"]), atol=1e-4)


def _one_error_line(args: list[Any], *says: str) -> str:
    code, out, err = run(*args)
    assert code == 2, (out, err)
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert "Traceback" not in err + out
    assert all(s in lines[0] for s in says), lines[0]
    return lines[0]


@pytest.mark.parametrize("cut", ["empty", "header", "half", "last_bytes", "magic"])
def test_a_truncated_or_corrupt_gguf_file_is_one_error_line(cut: str, pair: dict[str, Any], tmp_path: Path) -> None:
    data = pair["a_path"].read_bytes()
    bad = {"empty": b"", "header": data[:40], "half": data[: len(data) // 2], "last_bytes": data[:-8],
           "magic": b"GGUX" + data[4:]}[cut]
    path = tmp_path / "bad.gguf"
    path.write_bytes(bad)
    _one_error_line(["check", path, "--samples", "1"], str(path))
    out = tmp_path / "o"
    _one_error_line(["match", pair["a_path"], path, "--out", out], str(path))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.gguf"], "a failed match wrote files"
    assert path.read_bytes() == bad
    with pytest.raises(ModelLoadError, match="GGUF"):
        load_model(path)


def test_an_architecture_transformers_cannot_read_is_named(pair: dict[str, Any], tmp_path: Path) -> None:
    path = write_gguf(pair["a"], tmp_path / "grok.gguf", arch="grok")
    line = _one_error_line(["check", path, "--samples", "1"], str(path), "'grok'", "cannot read GGUF architecture")
    assert "llama" in line  # what it does read


def test_one_shard_of_a_split_gguf_model_says_how_to_merge_the_shards(pair: dict[str, Any], tmp_path: Path) -> None:
    path = write_gguf(pair["a"], tmp_path / "a-00001-of-00003.gguf", shards=3)
    _one_error_line(["check", path, "--samples", "1"], str(path), "split in 3 files", "llama-gguf-split --merge")
    # the same file, one shard of one: it loads
    assert load_model(write_gguf(pair["a"], tmp_path / "whole.gguf", shards=1)).format == "hf"


@pytest.mark.parametrize("module", ["gguf", "accelerate"])
def test_without_the_gguf_extra_the_error_says_how_to_install_it(module: str, pair: dict[str, Any],
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, module, None)  # `import MODULE` raises ImportError
    _one_error_line(["check", pair["a_path"], "--samples", "1"], str(pair["a_path"]), f"needs {module}",
                    "pip install 'symspec[gguf]'")
    monkeypatch.undo()
    assert load_model(pair["a_path"]).format == "hf"  # the positive control: with it, the file loads


def test_universe_of_gguf_files_writes_folders_named_without_the_suffix(pair: dict[str, Any]) -> None:
    out = pair["dir"] / "universe"
    code, _, err = run("universe", pair["a_path"], pair["b_path"], "--out", out, "--json")
    assert code == 0, err
    # Hugging Face folders, not folders named like GGUF files
    assert sorted(p.name for p in (out / "aligned").iterdir()) == ["00-a", "01-b"]
    for folder in (out / "merged", out / "aligned" / "01-b"):
        assert load_model(folder).format == "hf"
    assert torch.allclose(logits(load_model(out / "merged").model), logits(pair["a"]), atol=1e-4)


def test_infer_and_barrier_take_gguf_files(pair: dict[str, Any]) -> None:
    import random

    d = pair["dir"]
    code, _, err = run("infer", pair["a_path"], "--out", d / "inferred.yaml")
    assert code == 0, err
    assert (d / "inferred.yaml").is_file()
    # a character text over the model's 32 symbols
    rng = random.Random(0)
    text = d / "chars.txt"
    text.write_text("".join(rng.choice("abcdefghijklmnopqrstuvwxyzABCDEF") for _ in range(3000)))
    code, out, err = run("barrier", pair["a_path"], pair["b_path"], "--data", f"text:{text}", "--points", "3", "--json")
    assert code == 0, err
    assert json.loads(out)["data"]["vocab"] == 32
