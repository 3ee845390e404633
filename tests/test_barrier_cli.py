"""``symspec barrier``: reports, files, several pairs and methods, and exit code 2 for bad input."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from symspec.analyzers.report import REPORT_SCHEMA
from symspec.analyzers.testing import fit, planted_pair
from symspec.data import load_data, write_idx
from symspec.loading import load_model
from tests.cli_files import ROOT, model_file, run, write_words

VIT_MODEL = '''
import torch
from symspec.loading import import_file

_vit = import_file({path!r})


def build():
    torch.manual_seed(0)
    return _vit.build(image_size=8, patch_size=4, n_layer=1, n_head=2, n_embd=8, mlp_ratio=2)


example_inputs = _vit.example_inputs
'''


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A word text, a model file, and checkpoints: two trained models, random ones, a planted pair."""
    d = tmp_path_factory.mktemp("barrier_cli")
    text = d / "words.txt"
    vocab = write_words(text)
    mf = model_file(d, "gpt.py", vocab)
    out: dict[str, Path] = {"dir": d, "text": text, "model": mf}
    loaded = load_model(mf)
    train = load_data(f"text:{text}", model=loaded.model, split="train", batch_size=32)
    cls, cfg = type(loaded.model), loaded.model.config
    for i in range(2):
        torch.manual_seed(100 + i)  # two independent initialisations
        m = cls(cfg)
        fit(m, train, steps=40, lr=2e-2, seed=i)
        out[f"t{i}"] = d / f"trained{i}.pt"
        torch.save(m.state_dict(), out[f"t{i}"])
        if i == 0:
            planted = planted_pair(m, "nanogpt", seed=7)
            out["pa"], out["pb"] = d / "planted_a.pt", d / "planted_b.pt"
            torch.save(planted.sd_a, out["pa"])
            torch.save(planted.sd_b, out["pb"])
    for i in range(4):
        torch.manual_seed(i)
        out[f"r{i}"] = d / f"random{i}.pt"
        torch.save(cls(cfg).state_dict(), out[f"r{i}"])
    out["vocab"] = Path(str(vocab))
    return out


def test_json_report_of_one_pair(files: dict[str, Path]) -> None:
    jsonschema = pytest.importorskip("jsonschema")
    code, out, _ = run("barrier", files["t0"], files["t1"], "--model", files["model"], "--data", f"text:{files['text']}",
                       "--points", "5", "--json")
    assert code == 0
    doc = json.loads(out)
    jsonschema.validate(doc, REPORT_SCHEMA)
    assert doc["points"] == 5 and doc["lambdas"] == [0.0, 0.25, 0.5, 0.75, 1.0]
    (m,) = doc["methods"]
    assert m["method"] == "none" and m["summary"]["n"] == 1 and m["summary"]["barrier_stderr"] is None
    pair = m["pairs"][0]
    gaps = [loss - ((1 - t) * pair["loss"][0] + t * pair["loss"][-1]) for t, loss in zip(doc["lambdas"], pair["loss"])]
    assert pair["barrier"] == pytest.approx(max(gaps), abs=1e-12)
    assert pair["accuracy"] is not None and min(pair["accuracy"]) >= 0


def test_a_model_with_itself_over_the_cli(files: dict[str, Path]) -> None:
    code, out, _ = run("barrier", files["t0"], files["t0"], "--model", files["model"], "--data", f"text:{files['text']}",
                       "--points", "3", "--json")
    assert code == 0
    assert abs(json.loads(out)["methods"][0]["summary"]["barrier_mean"]) <= 1e-6


def test_tables_and_written_files(files: dict[str, Path], tmp_path: Path) -> None:
    png, rep, md = tmp_path / "c.png", tmp_path / "r.json", tmp_path / "r.md"
    code, out, _ = run("barrier", files["t0"], files["t1"], "--model", files["model"], "--data", f"text:{files['text']}",
                       "--points", "3", "--plot", png, "--report", rep, "--markdown", md)
    assert code == 0
    assert "vanilla averaging" in out and "loss barrier" in out and f"wrote {png}" in out
    assert png.read_bytes()[:4] == b"\x89PNG"
    doc = json.loads(rep.read_text())
    barrier = doc["methods"][0]["summary"]["barrier_mean"]
    assert f"{barrier:.4f}" in md.read_text() and f"{barrier:.4f}" in out


def test_several_pairs_report_standard_errors(files: dict[str, Path]) -> None:
    code, out, _ = run("barrier", files["r0"], files["r1"], "--pair", files["r2"], files["r3"], "--pair", files["t0"],
                       files["t1"], "--model", files["model"], "--data", f"text:{files['text']}", "--points", "3", "--json")
    assert code == 0
    doc = json.loads(out)
    s = doc["methods"][0]["summary"]
    assert s["n"] == 3 and s["barrier_stderr"] is not None and len(doc["pairs"]) == 3
    assert doc["pairs"][1] == {"index": 1, "a": str(files["r2"]), "b": str(files["r3"])}


def test_the_planted_pair_has_a_barrier_over_the_cli(files: dict[str, Path]) -> None:
    code, out, _ = run("barrier", files["pa"], files["pb"], "--model", files["model"], "--data", f"text:{files['text']}",
                       "--points", "5", "--json")
    assert code == 0
    s = json.loads(out)["methods"][0]["summary"]
    assert s["loss_a_mean"] == pytest.approx(s["loss_b_mean"], rel=1e-5)
    assert s["barrier_mean"] > 0.1


def test_weight_alignment_over_the_cli(files: dict[str, Path]) -> None:
    code, out, _ = run("barrier", files["pa"], files["pb"], "--model", files["model"], "--data", f"text:{files['text']}",
                       "--align", "none", "--align", "weight-perm", "--align", "weight", "--points", "5", "--json")
    assert code == 0
    doc = json.loads(out)
    methods = {m["method"]: m["summary"] for m in doc["methods"]}
    assert list(methods) == ["none", "weight-perm", "weight"]
    assert methods["none"]["barrier_mean"] > 0.1
    assert methods["weight"]["barrier_mean"] <= 1e-4 < methods["weight-perm"]["barrier_mean"]
    aligned = doc["methods"][2]["pairs"][0]
    assert aligned["align"]["spec"] == "nanogpt" and aligned["align_seconds"] > 0


def test_the_model_files_data_hook_needs_no_data_option(files: dict[str, Path], tmp_path: Path) -> None:
    hook = f'''

def data(split, batch_size=8, max_samples=None):
    torch.manual_seed({{"train": 0, "val": 1, "test": 2}}[split])
    x = torch.randint({files["vocab"]}, (20, 16))
    return [((x[i:i + batch_size],), x[i:i + batch_size]) for i in range(0, 20, batch_size)]
'''
    mf = model_file(tmp_path, "hooked.py", int(str(files["vocab"])), extra=hook)
    code, out, _ = run("barrier", files["t0"], files["t1"], "--model", mf, "--points", "3", "--json")
    assert code == 0
    assert json.loads(out)["data"]["kind"] == "hook" and json.loads(out)["data"]["examples"] == 20
    code, _, err = run("barrier", files["t0"], files["t1"], "--model", files["model"], "--points", "3")
    assert code == 2 and "no data: pass --data" in err


# ----------------------------------------------------------------------------- bad input: exit 2

def test_fewer_than_two_points(files: dict[str, Path]) -> None:
    for k in ("1", "0"):
        code, _, err = run("barrier", files["t0"], files["t1"], "--model", files["model"], "--data",
                           f"text:{files['text']}", "--points", k)
        assert code == 2 and "--points" in err
    code, _, _ = run("barrier", files["t0"], files["t1"], "--model", files["model"], "--data", f"text:{files['text']}",
                     "--points", "2", "--json")
    assert code == 0


def test_text_that_does_not_fit_the_vocabulary(files: dict[str, Path], tmp_path: Path) -> None:
    wider = tmp_path / "wider.txt"
    wider.write_text(files["text"].read_text() + "XYZ")
    code, out, err = run("barrier", files["t0"], files["t1"], "--model", files["model"], "--data", f"text:{wider}")
    assert code == 2 and out == ""
    assert f"its alphabet has {int(str(files['vocab'])) + 3} characters but the model's vocabulary has" in err
    assert "Traceback" not in err


def test_images_that_do_not_fit_the_model(tmp_path: Path) -> None:
    vf = tmp_path / "vit.py"
    vf.write_text(VIT_MODEL.format(path=str(ROOT / "examples" / "vit.py")))
    folder = tmp_path / "mnist"
    folder.mkdir()
    g = torch.Generator().manual_seed(0)
    write_idx(folder / "t10k-images-idx3-ubyte.gz", torch.randint(0, 256, (40, 12, 12), generator=g, dtype=torch.uint8))
    write_idx(folder / "t10k-labels-idx1-ubyte.gz", torch.randint(0, 10, (40,), generator=g).to(torch.uint8))
    code, _, err = run("barrier", vf, vf, "--data", f"mnist:{folder}")
    assert code == 2 and "images are 12x12 but the model takes 8x8" in err
    code, out, _ = run("barrier", vf, vf, "--data", f"mnist:{folder},size=8", "--points", "3", "--json")
    assert code == 0 and json.loads(out)["data"]["image_size"] == [8, 8]
    code, out, _ = run("barrier", vf, vf, "--data", "digits", "--points", "3", "--json")
    assert code == 0 and json.loads(out)["methods"][0]["pairs"][0]["accuracy"] is not None


def test_models_of_different_shapes(files: dict[str, Path], tmp_path: Path) -> None:
    vocab = int(str(files["vocab"]))
    narrow, wide = model_file(tmp_path, "narrow.py", vocab, d=16), model_file(tmp_path, "wide.py", vocab, d=24)
    # vanilla averaging lifts a narrower B (docs/width.md), so a narrower A is said as such
    code, _, err = run("barrier", narrow, wide, "--data", f"text:{files['text']}")
    assert code == 2 and "A is narrower than B in resid (16 < 24)" in err and "give the wider model as A" in err
    wide_sd = tmp_path / "wide.pt"
    torch.save(load_model(wide).model.state_dict(), wide_sd)
    code, _, err = run("barrier", files["t0"], wide_sd, "--model", files["model"], "--data", f"text:{files['text']}")
    assert code == 2 and "has shape" in err


def test_an_empty_split(files: dict[str, Path]) -> None:
    code, _, err = run("barrier", files["t0"], files["t1"], "--model", files["model"], "--data",
                       f"text:{files['text']},split=1/0/0")
    assert code == 2 and "the val split holds 0 characters" in err
    code, _, _ = run("barrier", files["t0"], files["t1"], "--model", files["model"], "--data",
                     f"text:{files['text']},split=1/0/0", "--split", "train", "--max-samples", "4", "--points", "2")
    assert code == 0


def test_other_bad_input(files: dict[str, Path]) -> None:
    base = ("barrier", files["t0"], files["t1"], "--model", files["model"])
    code, _, err = run(*base, "--data", "txt:nowhere")
    assert code == 2 and "did you mean 'text'" in err
    code, _, err = run("barrier", files["t0"], files["t1"], "--data", f"text:{files['text']}")
    assert code == 2 and "needs the model it belongs to" in err
    if not torch.cuda.is_available():
        code, _, err = run(*base, "--data", f"text:{files['text']}", "--device", "cuda")
        assert code == 2 and "CUDA is not available" in err


def test_help_does_not_import_torch_or_matplotlib() -> None:
    code = ("import sys\nfrom click.testing import CliRunner\nfrom symspec.cli.main import cli\n"
            "r = CliRunner().invoke(cli, ['barrier', '--help'])\n"
            "print(r.exit_code, 'torch' in sys.modules, 'matplotlib' in sys.modules, 'symspec.data' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["0", "False", "False", "False"]


def test_a_hugging_face_folder_without_logits_is_told_to_pass_a_loss_hook(files: dict[str, Path], tmp_path: Path) -> None:
    # the message once said "define loss(output, targets) in the model file": a folder has none
    from tests.needs import optional

    transformers = optional("transformers")
    vocab = len(set(files["text"].read_text()))
    config = transformers.GPT2Config(vocab_size=vocab, n_positions=16, n_embd=8, n_layer=1, n_head=2,
                                     bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    transformers.GPT2Model(config).save_pretrained(tmp_path / "base")  # no LM head: hidden states, no logits
    args = ("barrier", tmp_path / "base", tmp_path / "base", "--data", f"text:{files['text']}", "--points", "2",
            "--max-samples", "4")
    code, _, err = run(*args)
    line = err.strip().splitlines()[-1]
    assert code == 2 and line.startswith("error: cannot find logits"), err
    assert "--model hooks.py" in line and "'import torch'" in line and "'def loss(output, targets): return ...'" in line
    assert "output.last_hidden_state" in line
    # the advice, followed: the two lines (the return filled in) make the same command work
    hooks = tmp_path / "hooks.py"
    hooks.write_text("import torch\ndef loss(output, targets): return output.last_hidden_state.pow(2).mean()\n")
    code, out, err = run(*args, "--model", hooks)
    assert code == 0, err
    assert "vanilla averaging" in out
