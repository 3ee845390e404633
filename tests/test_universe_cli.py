"""``symspec universe``: outputs and report, the analysis, exit code 2 for bad input and
for a dying worker (nothing half-written; the rerun resumes and gives the same model)."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import torch

from symspec.analyzers.interpolate import PathEvaluator
from symspec.analyzers.simplex import ANALYSIS_SCHEMA
from symspec.analyzers.testing import fit
from symspec.binding import bind
from symspec.data import load_data
from symspec.loading import load_model
from symspec.record import TransformRecord
from symspec.spec import load_spec
from symspec.universe import report_schema
from tests.cli_files import model_file, run, write_words


def crash_hook() -> None:
    """Worker setup (``--setup tests.test_universe_cli:crash_hook``): with
    SYMSPEC_TEST_CRASH=NAME@ROUND, the worker aligning the model whose name ends with NAME
    in round ROUND dies by SIGKILL, as under the kernel's OOM killer."""
    spec = os.environ.get("SYMSPEC_TEST_CRASH")
    if not spec:
        return
    name, _, rnd = spec.partition("@")
    import symspec.universe.tasks as W

    original = W.align

    def align(task: Any, cfg: Any, searched: Any) -> Any:
        if task.name.endswith(name) and f"rounds/{int(rnd):03d}/" in task.universe:
            os.kill(os.getpid(), signal.SIGKILL)
        return original(task, cfg, searched)

    W.align = align


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A word text, a model file, three briefly trained checkpoints and a list of them."""
    d = tmp_path_factory.mktemp("universe_cli")
    text = d / "words.txt"
    vocab = write_words(text)
    mf = model_file(d, "gpt.py", vocab)
    model_file(d, "gpt_wide.py", vocab, d=32)
    mod = load_model(mf).model_file.module  # type: ignore[union-attr]
    for s in range(3):
        m = mod.build()  # seeds itself: reinitialise, seeded per model
        torch.manual_seed(100 + s)
        for p in m.parameters():
            if p.dim() > 1:
                torch.nn.init.normal_(p, std=0.1)
        data = load_data(f"text:{text},context=16", model=m, split="train", batch_size=32, max_samples=256)
        fit(m, data, steps=60, seed=s)
        torch.save(m.state_dict(), d / f"seed{s}.pt")
    (d / "models.txt").write_text("# three seeds\nseed0.pt\nseed1.pt\nseed2.pt\n")
    (d / "garbage.pt").write_bytes(b"not a checkpoint")
    return {"dir": d, "text": text, "model": mf, "wide": d / "gpt_wide.py", "list": d / "models.txt",
            "garbage": d / "garbage.pt", **{f"seed{s}": d / f"seed{s}.pt" for s in range(3)}}


@pytest.fixture(scope="module")
def baseline(files: dict[str, Path]) -> dict[str, Any]:
    """One run in this process (no workers), with the analysis over the simplex."""
    out = files["dir"] / "out"
    code, stdout, stderr = run("universe", f"@{files['list']}", "--model", files["model"], "--out", out,
                               "--rounds", 2, "--tol", 0, "--method", "weight", "--data", f"text:{files['text']},context=16",
                               "--max-samples", 64, "--resolution", 6, "--json")
    assert code == 0, stderr
    return {"out": out, "report": json.loads(stdout)}


def test_report_follows_its_schema_and_lists_the_outputs(baseline: dict[str, Any]) -> None:
    report, out = baseline["report"], baseline["out"]
    jsonschema.validate(report, report_schema(ANALYSIS_SCHEMA))
    assert report["analysis"] is not None and report["method"] == "weight"
    assert report == json.loads((out / "report.json").read_text())
    assert report["executor"] == "inline" and report["rounds"] == 2 and report["spec"] == "nanogpt"
    assert report["outputs"]["merged"] == str(out / "merged.pt")
    assert [Path(p).name for p in report["outputs"]["aligned"]] == ["00-seed0.pt", "01-seed1.pt", "02-seed2.pt"]
    assert (out / "simplex.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert report["outputs"]["simplex_plot"] == str(out / "simplex.png")
    assert not (out.parent / ".out.partial").exists()  # the work folder is gone once the outputs are written
    bad = dict(report, schema="symspec.barrier/1")
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, report_schema(ANALYSIS_SCHEMA))
    # the analysis part is checked against the analyzers' schema when given
    broken = dict(report, analysis={"models": []})
    jsonschema.validate(broken, report_schema())
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(broken, report_schema(ANALYSIS_SCHEMA))


def test_merged_model_loads_as_the_input_class_and_beats_plain_averaging(files: dict[str, Path],
                                                                       baseline: dict[str, Any]) -> None:
    report, out = baseline["report"], baseline["out"]
    a = report["analysis"]
    merged = load_model(out / "merged.pt", factory=files["model"])
    assert type(merged.model).__name__ == "GPT"
    data = load_data(f"text:{files['text']},context=16", model=merged.model, split="val", max_samples=64)
    loss = PathEvaluator(merged.model, data).evaluate(merged.model.state_dict()).loss
    assert loss == pytest.approx(a["merged"]["loss"], abs=1e-5)
    assert a["merged"]["loss"] < a["plain_average"]["loss"] - 0.1
    assert a["merged_gap"] < a["plain_gap"]
    for m in a["models"]:  # aligning keeps each model's function
        assert m["aligned_loss"] == pytest.approx(m["loss"], abs=1e-5)
    plain, uni = a["simplex"]
    assert (plain["method"], uni["method"]) == ("plain", "universe")
    assert len(uni["weights"]) == 28  # resolution 6 over 3 models
    assert uni["max_deviation"] < plain["max_deviation"]
    assert plain["centroid_deviation"] == pytest.approx(a["plain_gap"], abs=1e-6)


def test_transform_records_map_each_model_onto_its_aligned_output(files: dict[str, Path], baseline: dict[str, Any]) -> None:
    out = baseline["out"]
    rec = TransformRecord.load(out / "transforms" / "01-seed1")
    assert rec.meta["method"] == "universe" and rec.meta["model"] == str(files["dir"] / "seed1.pt")
    raw = load_model(files["seed1"], factory=files["model"]).model
    bound = bind(load_spec("nanogpt"), raw)
    mapped = rec.apply(bound, {k: v.detach() for k, v in raw.state_dict().items()})
    aligned = torch.load(out / "aligned" / "01-seed1.pt", weights_only=True)
    assert max(float((mapped[k] - aligned[k]).abs().max()) for k in bound.problem.params) <= 1e-5
    other = torch.load(out / "aligned" / "02-seed2.pt", weights_only=True)
    assert max(float((mapped[k] - other[k]).abs().max()) for k in bound.problem.params) > 1e-2


@pytest.mark.slow
def test_a_dying_worker_is_named_nothing_is_written_and_the_rerun_resumes(
        files: dict[str, Path], baseline: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    out = files["dir"] / "crashed"
    args = ["universe", files["seed0"], files["seed1"], files["seed2"], "--model", files["model"], "--out", out,
            "--rounds", 2, "--tol", 0, "--jobs", 2, "--setup", "tests.test_universe_cli:crash_hook"]
    monkeypatch.setenv("SYMSPEC_TEST_CRASH", "seed2.pt@2")
    code, _, stderr = run(*args)
    assert code == 2
    assert "1 model(s) failed in round 2" in stderr
    assert f"{files['seed2']}: the worker process died while working on it (killed by SIGKILL" in stderr
    assert "rerun the same command to resume" in stderr
    assert not out.exists()
    partial = files["dir"] / ".crashed.partial"
    assert sorted(p.name for p in (partial / "rounds" / "002").glob("*.json")) == ["00-seed0.json", "01-seed1.json"]
    monkeypatch.delenv("SYMSPEC_TEST_CRASH")
    code, stdout, stderr = run(*args, "--json")
    assert code == 0, stderr
    report = json.loads(stdout)
    assert report["executor"] == "processes" and report["jobs"] == 2
    assert report["resumed_tasks"] == 3 + 2  # the canonical forms, and round 2's finished models
    assert not partial.exists()
    # the same merged model as the run in one process, bit for bit
    a, b = torch.load(out / "merged.pt", weights_only=True), torch.load(baseline["out"] / "merged.pt", weights_only=True)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert report["objective"] == baseline["report"]["objective"]


def test_bad_inputs_exit_2_and_write_nothing(files: dict[str, Path]) -> None:
    d = files["dir"]
    out = d / "never"
    cases = [
        ([files["seed0"], d / "nowhere.pt"], "no such file or folder: " + str(d / "nowhere.pt")),
        ([str(d / "*.safetensors")], "*.safetensors: no file matches"),
        ([files["seed0"]], "needs at least 2 models, got 1"),
        ([f"@{d / 'missing.txt'}"], "no such list of models"),
        ([files["seed0"], files["garbage"]], f"{files['garbage']}: cannot be read as a state dict"),
        ([files["model"], files["wide"]], f"{files['wide']} does not share the architecture of {files['model']}: ",
         "space resid is OC(32) here but OC(16) in the reference"),
    ]
    for models, *messages in cases:
        code, _stdout, stderr = run("universe", *models, "--model", files["model"], "--out", out)
        assert code == 2, (models, stderr)
        assert all(m in stderr for m in messages), stderr
        assert "Traceback" not in stderr and not out.exists() and not list(d.glob(".never*"))
    (d / "occupied").mkdir(exist_ok=True)
    code, _, stderr = run("universe", files["seed0"], files["seed1"], "--model", files["model"], "--out", d / "occupied")
    assert code == 2 and "exists; refusing to overwrite it (use --overwrite)" in stderr
    code, _, stderr = run("universe", files["seed0"], files["seed1"], "--model", files["model"], "--out", out,
                          "--groups", "perms")
    assert code == 2 and "unknown restriction 'perms'" in stderr and not out.exists()


def test_overwrite_and_human_output(files: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "two"
    out.mkdir()
    (out / "stale.txt").write_text("old")
    code, stdout, stderr = run("universe", files["seed0"], files["seed2"], "--model", files["model"], "--out", out,
                               "--rounds", 1, "--overwrite", "--groups", "perm")
    assert code == 0, stderr
    assert "symspec universe: 2 models, spec nanogpt (perm groups), 1 round(s)" in stdout
    assert "wrote " + str(out / "merged.pt") in stdout
    assert not (out / "stale.txt").exists() and (out / "merged.pt").exists()
    rec = TransformRecord.load(out / "transforms" / "01-seed2")
    assert rec.searched["resid"] == "S(16)"


def test_the_rounds_align_with_the_method_asked_for(files: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "perm"
    code, stdout, stderr = run("universe", files["seed0"], files["seed2"], "--model", files["model"], "--out", out,
                               "--rounds", 1, "--method", "weight-perm", "--json")
    assert code == 0, stderr
    report = json.loads(stdout)
    assert report["method"] == "weight-perm" and report["groups"] == "perm"  # the method's own groups
    assert TransformRecord.load(out / "transforms" / "01-seed2").meta["alignment"] == "weight-perm"
    code, _, stderr = run("universe", files["seed0"], files["seed2"], "--model", files["model"], "--out",
                          tmp_path / "never", "--method", "wieght")
    assert code == 2 and "unknown alignment method 'wieght'; did you mean 'weight'" in stderr
    code, _, stderr = run("universe", files["seed0"], files["seed2"], "--model", files["model"], "--out",
                          tmp_path / "never", "--method", "universe")
    assert code == 2 and "cannot align with 'universe'" in stderr and not (tmp_path / "never").exists()


@pytest.mark.slow
def test_hugging_face_folders_stay_hugging_face_folders(tmp_path: Path) -> None:
    from tests.zoo import ZOO

    inputs = []
    for s in range(3):
        model, example = ZOO["gpt2"](seed=s)
        model.save_pretrained(tmp_path / f"m{s}")
        inputs.append((model, example))
    out = tmp_path / "out"
    code, stdout, stderr = run("universe", *(tmp_path / f"m{s}" for s in range(3)), "--out", out, "--rounds", 2, "--json")
    assert code == 0, stderr
    report = json.loads(stdout)
    assert [m["format"] for m in report["models"]] == ["hf"] * 3 and report["spec"] == "gpt2"
    merged = load_model(out / "merged")
    assert merged.format == "hf" and type(merged.model).__name__ == "GPT2LMHeadModel"
    for s in (0, 2):  # an aligned model, saved and reloaded, computes what its input computes
        model, example = inputs[s]
        aligned = load_model(out / "aligned" / f"0{s}-m{s}").model
        with torch.no_grad():
            assert torch.allclose(aligned(**example).logits, model(**example).logits, atol=1e-4)
    assert (out / "transforms" / "01-m1" / "transform.json").exists()
