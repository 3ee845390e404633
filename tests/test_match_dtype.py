"""Half-precision checkpoints through ``symspec match`` and ``symspec merge``: matched in
float32, written back in the dtype they were stored in (issue #12, part B)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import symspec
from tests.test_match_cli import MODEL_FILE, run
from tests.zoo import EXAMPLES, ZOO

DTYPES = [torch.float16, torch.bfloat16]


def floating_dtypes(path: Path) -> dict[str, torch.dtype]:
    """The dtype of every floating-point tensor in a checkpoint or a Hugging Face folder."""
    from safetensors.torch import load_file

    if path.is_dir():
        sd = {}
        for f in sorted(path.glob("model*.safetensors")):  # not the transform record
            sd.update(load_file(str(f)))
    elif path.suffix == ".safetensors":
        sd = load_file(str(path))
    else:
        sd = torch.load(path, weights_only=True)
    assert sd, f"{path} holds no tensors"
    return {k: v.dtype for k, v in sd.items() if v.is_floating_point()}


def checkpoints(folder: Path, dtype: torch.dtype, suffix: str) -> tuple[Path, Path, Path]:
    """(model file, A, B): two nanoGPT checkpoints stored in ``dtype``."""
    from safetensors.torch import save_file

    model = folder / "model.py"
    model.write_text(MODEL_FILE.format(examples=str(EXAMPLES), n_ff=12))
    paths = []
    for name, seed in (("a", 0), ("b", 1)):
        m, _ = ZOO["nanogpt"](seed=seed)
        sd = {k: v.detach().to(dtype).contiguous() for k, v in m.state_dict().items()}
        path = folder / f"{name}.{suffix}"
        if suffix == "safetensors":
            save_file({k: v.clone() for k, v in sd.items() if k != "lm_head.weight"}, str(path))
        else:
            torch.save(sd, path)
        paths.append(path)
    return model, paths[0], paths[1]


@pytest.mark.parametrize("suffix", ["pt", "safetensors"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_state_dict_checkpoints_keep_their_dtype(tmp_path: Path, dtype: torch.dtype, suffix: str) -> None:
    model, a, b = checkpoints(tmp_path, dtype, suffix)
    stored = floating_dtypes(b)
    assert set(stored.values()) == {dtype}
    for command, extra in (("match", []), ("merge", []), ("merge", ["--no-align"])):
        out = tmp_path / f"{command}{''.join(extra)}"
        code, stdout, stderr = run(command, a, b, "--model", model, "--out", out, "--json", *extra)
        assert code == 0, stderr
        written = floating_dtypes(out / f"model.{suffix}")
        assert set(written) >= set(stored)
        assert set(written.values()) == {dtype}, (command, extra, written)
        if "--no-align" not in extra:
            objective = json.loads(stdout)["objective"]
            assert objective[-1] < objective[0] and min(objective) >= 0
            # the record holds the elements of the float32 solve
            assert json.loads((out / "transform.json").read_text())["meta"]["dtype"] == "float32"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_hugging_face_folders_keep_their_dtype(tmp_path: Path, dtype: torch.dtype) -> None:
    pytest.importorskip("transformers")
    import transformers

    for name, seed in (("a", 0), ("b", 1)):
        m, _ = ZOO["llama"](seed=seed)
        m.to(dtype).save_pretrained(str(tmp_path / name))
    assert set(floating_dtypes(tmp_path / "b").values()) == {dtype}
    for command in ("match", "merge"):
        out = tmp_path / command
        # bfloat16 on the CPU has no SVD: this was a traceback before the solve ran in float32
        code, _, stderr = run(command, tmp_path / "a", tmp_path / "b", "--out", out, "--json")
        assert code == 0, stderr
        assert set(floating_dtypes(out).values()) == {dtype}
        back = transformers.AutoModelForCausalLM.from_pretrained(str(out))
        assert next(back.parameters()).dtype == dtype


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_weight_match_returns_each_inputs_dtype(dtype: torch.dtype) -> None:
    a, _ = ZOO["llama"](seed=0)
    b, _ = ZOO["llama"](seed=1)
    res = symspec.align(a.to(dtype), b.to(dtype), "llama", method="weight", rounds=3)
    for sd in (res.canonical_a, res.canonical_b, res.aligned_b):
        assert sd is not None
        assert {v.dtype for v in sd.values() if v.is_floating_point()} == {dtype}
    assert res.record.meta["dtype"] == "float32"
    assert all(e.dtype == torch.float32 for el in res.elements.values() for e in el.values() if e.is_floating_point())
    assert min(res.history) >= 0 and res.history[-1] < res.history[0]
    # the aligned model still computes B's function (to bfloat16's 3 digits)
    model = res.canonical_model
    assert model is not None
    ids = torch.randint(0, a.config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(0))
    model.load_state_dict(res.aligned_b)
    with torch.no_grad():
        got = model(input_ids=ids, use_cache=False).logits.float()
        want = b(input_ids=ids, use_cache=False).logits.float()
    assert torch.allclose(got, want, atol=0.05 * float(want.abs().max()))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_universe_keeps_each_models_dtype(tmp_path: Path, dtype: torch.dtype) -> None:
    # a state-dict checkpoint (read into the float32 module of the model file) and a
    # Hugging Face folder (read in its own dtype, where the solve used to fail)
    pytest.importorskip("transformers")
    model, a, b = checkpoints(tmp_path, dtype, "pt")
    for name, seed in (("ha", 0), ("hb", 1)):
        m, _ = ZOO["llama"](seed=seed)
        m.to(dtype).save_pretrained(str(tmp_path / name))
    for models, extra in (([a, b], ["--model", model]), ([tmp_path / "ha", tmp_path / "hb"], [])):
        out = tmp_path / f"universe-{models[0].stem}"
        code, _, stderr = run("universe", *models, "--out", out, "--rounds", "1", *extra)
        assert code == 0, stderr
        written = [out / "merged.pt"] if (out / "merged.pt").exists() else [out / "merged"]
        written += sorted((out / "aligned").iterdir())
        assert len(written) == 3
        for path in written:
            assert set(floating_dtypes(path).values()) == {dtype}, path
