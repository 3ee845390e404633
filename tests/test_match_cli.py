"""``symspec match`` and ``symspec merge``: formats in and out, summaries, exit codes,
atomic outputs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from symspec.cli.main import cli
from symspec.record import TransformRecord
from tests.zoo import EXAMPLES, ZOO

MODEL_FILE = """
import sys
sys.path.insert(0, {examples!r})
from nanogpt import build as _build, example_inputs

def build(**kw):
    return _build(n_layer=2, n_head=2, n_embd=8, n_ff={n_ff}, vocab_size=11, block_size=8)

SPEC = "nanogpt"
"""


def run(*args: str | Path) -> tuple[int, str, str]:
    result = CliRunner().invoke(cli, [str(a) for a in args])
    return result.exit_code, result.stdout, result.stderr


@pytest.fixture
def files(tmp_path: Path) -> dict[str, Path]:
    """Two nanoGPT checkpoints (.pt and .safetensors) and their model file."""
    from safetensors.torch import save_file

    (tmp_path / "model.py").write_text(MODEL_FILE.format(examples=str(EXAMPLES), n_ff=12))
    (tmp_path / "wide.py").write_text(MODEL_FILE.format(examples=str(EXAMPLES), n_ff=16))
    out = {"model": tmp_path / "model.py", "wide_model": tmp_path / "wide.py"}
    for name, seed in (("a", 0), ("b", 1)):
        m, _ = ZOO["nanogpt"](seed=seed)
        sd = {k: v.detach().contiguous() for k, v in m.state_dict().items()}
        torch.save(sd, tmp_path / f"{name}.pt")
        save_file({k: v.clone() for k, v in sd.items() if k != "lm_head.weight"}, str(tmp_path / f"{name}.safetensors"))
        out[name] = tmp_path / f"{name}.pt"
        out[f"{name}_st"] = tmp_path / f"{name}.safetensors"
    wide, _ = ZOO["nanogpt"](seed=2, n_ff=16)
    torch.save(wide.state_dict(), tmp_path / "wide.pt")
    out["wide"] = tmp_path / "wide.pt"
    return out


def test_match_writes_b_aligned_its_record_and_a_summary(files: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "aligned"
    code, stdout, stderr = run("match", files["a"], files["b"], "--model", files["model"], "--out", out, "--json")
    assert code == 0, stderr
    data = json.loads(stdout)
    assert data["spec"] == "nanogpt" and data["converged"] in (True, False)
    assert data["objective"][-1] < data["objective"][0]
    assert data["distance"]["aligned"] < data["distance"]["canonical"]
    assert {"stats", "solve:Heads", "total"} <= set(data["timings"])
    assert sorted(p.name for p in out.iterdir()) == ["match.json", "model.pt", "transform.json", "transform.safetensors"]
    assert json.loads((out / "match.json").read_text())["objective"] == data["objective"]
    # the aligned checkpoint is B re-parametrised: it computes what B computes
    import importlib.util

    spec = importlib.util.spec_from_file_location("m", files["model"])
    mod = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(mod)  # type: ignore[union-attr]
    b, aligned = mod.build(), mod.build()
    b.load_state_dict(torch.load(files["b"]))
    from symspec.loading import load_state_dict_into

    load_state_dict_into(aligned, torch.load(out / "model.pt"))
    x = mod.example_inputs(b)
    with torch.no_grad():
        assert torch.allclose(aligned(*x), b(*x), atol=1e-5)
    rec = TransformRecord.load(out)
    assert rec.spec == "nanogpt" and rec.meta["b"] == str(files["b"])
    # tables for people
    code, stdout, _ = run("match", files["a"], files["b"], "--model", files["model"], "--out", tmp_path / "again", "--groups", "perm")
    assert code == 0 and "objective" in stdout and "time per phase" in stdout and "wrote" in stdout


def test_match_keeps_the_safetensors_format(files: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "st"
    code, _, stderr = run("match", files["a_st"], files["b_st"], "--model", files["model"], "--out", out, "--rounds", "2")
    assert code == 0, stderr
    from safetensors.torch import load_file

    sd = load_file(str(out / "model.safetensors"))
    assert "transformer.h.0.mlp.c_fc.weight" in sd


def test_merge_interpolates_aligned_or_raw(files: dict[str, Path], tmp_path: Path) -> None:
    raw = tmp_path / "raw"
    code, stdout, stderr = run("merge", files["a"], files["b"], "--model", files["model"], "--out", raw, "--no-align", "--alpha", "0.25", "--json")
    assert code == 0, stderr
    a, b, m = torch.load(files["a"]), torch.load(files["b"]), torch.load(raw / "model.pt")
    k = "transformer.h.1.attn.c_attn.weight"
    assert torch.allclose(m[k], 0.75 * a[k] + 0.25 * b[k])
    assert json.loads(stdout)["aligned"] is False and not (raw / "transform.json").exists()
    merged = tmp_path / "merged"
    code, stdout, stderr = run("merge", files["a"], files["b"], "--model", files["model"], "--out", merged, "--json")
    assert code == 0, stderr
    data = json.loads(stdout)
    assert data["aligned"] is True and data["alpha"] == 0.5
    assert (merged / "transform.safetensors").exists() and (merged / "merge.json").exists()


def test_hugging_face_folders_stay_folders(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    for name, seed in (("a", 0), ("b", 1)):
        m, _ = ZOO["gpt2"](seed=seed)
        m.save_pretrained(str(tmp_path / name))
    out = tmp_path / "aligned"
    code, _, stderr = run("match", tmp_path / "a", tmp_path / "b", "--out", out, "--rounds", "2")
    assert code == 0, stderr
    assert (out / "config.json").exists() and (out / "transform.json").exists()
    aligned = transformers.GPT2LMHeadModel.from_pretrained(str(out))
    b = transformers.GPT2LMHeadModel.from_pretrained(str(tmp_path / "b"))
    x = torch.randint(23, (2, 8))
    with torch.no_grad():
        assert torch.allclose(aligned(x).logits, b(x).logits, atol=1e-4)


def _no_leftovers(folder: Path) -> bool:
    return not [p for p in folder.iterdir() if p.name.startswith(".")]


def test_bad_inputs_exit_2_and_write_nothing(files: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "out"
    # two models that do not fit one spec
    code, _, err = run("match", files["a"], files["wide"], "--model", files["model"], "--out", out)
    assert code == 2 and "error:" in err
    code, _, err = run("match", files["model"], files["wide_model"], "--out", out)
    # B wider than A (models of different widths are aligned with the wider one as A)
    assert code == 2 and "A is narrower than B in ff[0] (12 < 16)" in err
    # NaN weights
    sd = torch.load(files["b"])
    sd["transformer.h.0.mlp.c_proj.weight"][0, 0] = float("inf")
    torch.save(sd, tmp_path / "bad.pt")
    code, _, err = run("match", files["a"], tmp_path / "bad.pt", "--model", files["model"], "--out", out)
    assert code == 2 and "NaN or inf" in err and "c_proj.weight" in err
    # an output that cannot be written: its parent is a file
    (tmp_path / "afile").write_text("x")
    code, _, err = run("match", files["a"], files["b"], "--model", files["model"], "--out", tmp_path / "afile" / "out")
    assert code == 2 and "cannot write" in err
    # bad options
    code, _, err = run("match", files["a"], files["b"], "--model", files["model"], "--out", out, "--groups", "prem")
    assert code == 2 and "did you mean 'perm'" in err
    code, _, err = run("match", files["a"], files["b"], "--model", files["model"], "--out", out, "--device", "tpu")
    assert code == 2
    assert not out.exists() and _no_leftovers(tmp_path)


def test_existing_outputs_need_force(files: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    code, _, err = run("match", files["a"], files["b"], "--model", files["model"], "--out", out, "--rounds", "1")
    assert code == 2 and "--force" in err and (out / "keep.txt").read_text() == "mine"
    code, _, err = run("match", files["a"], files["b"], "--model", files["model"], "--out", out, "--rounds", "1", "--force")
    assert code == 0, err
    assert not (out / "keep.txt").exists() and (out / "model.pt").exists() and _no_leftovers(tmp_path)


def test_help_lists_the_commands() -> None:
    code, stdout, _ = run("--help")
    assert code == 0 and "match" in stdout and "merge" in stdout
    code, stdout, _ = run("match", "--help")
    assert code == 0 and "--groups" in stdout and "--device" in stdout
