"""Transform records: files, re-application to B, inversion, and refusals."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import symspec
from symspec.binding import bind
from symspec.record import INDEX, TENSORS, RecordError, TransformRecord
from symspec.transforms import apply_elements, canonicalize_state_dict, sample_elements
from tests.zoo import ZOO


def pair(name: str) -> tuple[torch.nn.Module, torch.nn.Module]:
    try:
        a, _ = ZOO[name](seed=0)
        b, _ = ZOO[name](seed=1)
    except ImportError as e:
        pytest.skip(f"{name} needs an optional package: {e}")
    return a.double(), b.double()


def state(m: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach() for k, v in m.state_dict().items()}


def close(x: dict[str, torch.Tensor], y: dict[str, torch.Tensor], atol: float = 1e-10) -> bool:
    return all(torch.allclose(x[k], y[k], atol=atol, rtol=0) for k in y if y[k].is_floating_point())


@pytest.mark.parametrize("name", ["nanogpt", "llama", "opt", "bert"])  # chains (opt, llama), sign (bert), GQA + RoPE (llama)
def test_saved_record_reapplies_to_b_and_inverts(name: str, tmp_path: Path) -> None:
    a, b = pair(name)
    res = symspec.align(a, b, name, method="weight", rounds=3)
    path = res.record.save(tmp_path)
    assert path == tmp_path / TENSORS and (tmp_path / INDEX).exists()
    index = json.loads((tmp_path / INDEX).read_text())
    assert index["format"] == "symspec-transform" and index["spec"] == name
    assert set(index["spaces"]) == set(res.bound.problem.spaces)
    assert all(index["spaces"][s]["group"] == str(si.group) for s, si in res.bound.problem.spaces.items())
    assert [op["kind"] for op in index["canonicalization"]] == [op.kind for op in res.bound.canonical]
    assert index["meta"]["objective"] == res.history

    rec = TransformRecord.load(tmp_path)
    assert rec.spec == name and rec.groups == res.record.groups
    # re-applied to B (canonicalised on the way), the record gives the aligned B
    assert close(rec.apply(res.bound, state(b)), res.aligned_b)
    # inverted, it maps aligned B back to canonical B (chains run backwards)
    inv = rec.inverse()
    assert inv.inverted and close(inv.apply(res.bound, res.aligned_b), res.canonical_b, atol=1e-9)
    assert close(inv.inverse().apply(res.bound, state(b)), res.aligned_b)
    # the same from the .json or the .safetensors path, and after a save of the inverse
    assert TransformRecord.load(tmp_path / INDEX).groups == rec.groups
    inv.save(tmp_path / "inverse.safetensors")
    again = TransformRecord.load(tmp_path / "inverse.safetensors")
    assert again.inverted and close(again.apply(res.bound, res.aligned_b), res.canonical_b, atol=1e-9)


def test_record_of_a_planted_pair_is_the_inverse_transform(tmp_path: Path) -> None:
    a, _ = pair("gpt2")
    bound = bind(symspec.load_spec("gpt2"), a)
    ca = canonicalize_state_dict(bound, state(a))
    g = sample_elements(bound.problem, seed=7)
    # recording g and inverting it undoes g
    rec = TransformRecord("gpt2", {s: str(si.group) for s, si in bound.problem.spaces.items()}, g)
    rec.save(tmp_path)
    moved = TransformRecord.load(tmp_path).apply(bound, ca, canonicalize=False)
    assert close(moved, apply_elements(bound.problem, g, ca))
    assert close(TransformRecord.load(tmp_path).inverse().apply(bound, moved), ca, atol=1e-9)


def test_records_refuse_models_of_another_spec_and_broken_files(tmp_path: Path) -> None:
    a, b = pair("nanogpt")
    res = symspec.align(a, b, "nanogpt", method="weight", rounds=1)
    res.record.save(tmp_path)
    rec = TransformRecord.load(tmp_path)
    v, _ = ZOO["vit"](seed=0)
    vb = bind(symspec.load_spec("vit"), v)
    with pytest.raises(RecordError, match=r"has no space attn|group is"):
        rec.apply(vb, state(v))
    bigger, _ = ZOO["nanogpt"](seed=0, n_ff=16)
    with pytest.raises(RecordError, match=r"ff\[0\]: the record's group is S\(12\), the model's is S\(16\)"):
        rec.apply(bind(symspec.load_spec("nanogpt"), bigger), state(bigger))
    with pytest.raises(RecordError, match="not found"):
        TransformRecord.load(tmp_path / "nowhere")
    (tmp_path / "junk.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(RecordError, match="not a readable safetensors"):
        TransformRecord.load(tmp_path / "junk.safetensors")
    # an element that does not fit its group
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(tmp_path / TENSORS))
    tensors["ff[0]/perm"] = torch.zeros(12, dtype=torch.int64)
    meta = {"symspec": json.dumps(res.record.index())}
    save_file(tensors, str(tmp_path / "bad.safetensors"), metadata=meta)
    with pytest.raises(RecordError, match=r"element of ff\[0\] does not have the structure of S\(12\)"):
        TransformRecord.load(tmp_path / "bad.safetensors")
