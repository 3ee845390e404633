"""Activation statistics that would not fit in the free memory are refused up front, in
one line naming what they need and what is free, instead of the process being killed
without a word (Qwen2-0.5B: float64 4864 x 4864 moments for every layer at once)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import symspec
import symspec.alignment.moments as moments_module
from symspec.graph import SiteRecorder, read_sites
from symspec.solvers.engine.activation_statistics import ActivationMoments
from tests.cli_files import WORDS, run, write_words
from tests.zoo import ZOO

transformers = pytest.importorskip("transformers")

VOCAB = len(set(" ".join(WORDS) + ".\n"))


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("actmem")
    text = root / "words.txt"
    write_words(text)
    out = {"text": text}
    for seed in (0, 1):
        ZOO["qwen2"](seed=seed, n_layer=1, vocab=VOCAB)[0].save_pretrained(root / f"m{seed}")
        out[f"m{seed}"] = root / f"m{seed}"
    return out


@pytest.mark.parametrize("method", ["activation", "weight+activation"])
def test_statistics_beyond_free_memory_are_one_line(folders: dict[str, Path], tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch, method: str) -> None:
    args = ["match", str(folders["m0"]), str(folders["m1"]), "--method", method, "--rounds", "1",
            "--data", f"text:{folders['text']},block=8"]
    monkeypatch.setattr(moments_module, "available_memory", lambda: 1000)
    code, _, err = run(*args, "--out", str(tmp_path / "o"))
    assert code == 2 and err.startswith("error: ") and len(err.strip().splitlines()) == 1, err
    assert "activation statistics" in err and "GB" in err and "--method weight" in err
    assert not (tmp_path / "o").exists()
    monkeypatch.setattr(moments_module, "available_memory", lambda: 1 << 40)  # the control: enough memory
    code, _, err = run(*args, "--out", str(tmp_path / "o2"))
    assert code == 0, err


def test_the_estimate_is_what_the_statistics_hold() -> None:
    """The planned bytes (meta tensors) are the bytes the real moments take."""
    model, inputs = ZOO["qwen2"](seed=0, n_layer=1, vocab=VOCAB)
    bound = symspec.bind("qwen2", model)
    rec = SiteRecorder(model, bound.problem, select=read_sites)
    rec.record(inputs)
    planned = ActivationMoments.empty(rec.sites, "meta", bound.problem)
    real = ActivationMoments.empty(rec.sites, "cpu", bound.problem)
    assert planned.bytes == real.bytes > 0
    moments_module.refuse_beyond_memory(planned, "m", available=2 * planned.bytes)  # fits: no error
    with pytest.raises(Exception, match="activation statistics of m need"):
        moments_module.refuse_beyond_memory(planned, "m", available=2 * planned.bytes - 1)
    assert torch.float64 in {t.dtype for m in real.moments.values() for t in m.cross}
