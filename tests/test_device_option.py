"""``--device`` of every command that takes one: a device this machine lacks or a word
that is no device is one ``error:`` line naming the option, exit 2, before any model is
loaded and with nothing written (the same command on the CPU is the positive control)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.cli_files import run, write_words
from tests.zoo import ZOO

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("device")
    text = root / "words.txt"
    vocab = write_words(text)
    out = {"text": text}
    for seed in (0, 1):
        model = ZOO["qwen2"](seed=seed, n_layer=1, vocab=vocab)[0]
        model.save_pretrained(root / f"m{seed}")
        out[f"m{seed}"] = root / f"m{seed}"
    return out


def _commands(f: dict[str, Path], out: Path) -> dict[str, list[str]]:
    a, b = str(f["m0"]), str(f["m1"])
    return {
        "check": ["check", a, "--samples", "1"],
        "match": ["match", a, b, "--rounds", "1", "--out", str(out)],
        "merge": ["merge", a, b, "--rounds", "1", "--out", str(out)],
        "barrier": ["barrier", a, b, "--points", "3", "--data", f"text:{f['text']},block=8", "--max-samples", "4"],
        "universe": ["universe", a, b, "--rounds", "1", "--out", str(out)],
    }


BAD = ["tpu", "cuda:x", "", "cpu:0"] + ([] if torch.cuda.is_available() else ["cuda", "cuda:0"])
BAD += [f"cuda:{torch.cuda.device_count()}"] if torch.cuda.is_available() else []


@pytest.mark.parametrize("command", ["check", "match", "merge", "barrier", "universe"])
def test_a_device_the_machine_lacks_is_one_line(folders: dict[str, Path], tmp_path: Path, command: str) -> None:
    out = tmp_path / "out"
    args = _commands(folders, out)[command]
    for bad in BAD:
        code, _, err = run(*args, "--device", bad)
        assert code == 2, (bad, err)
        assert err.startswith("error: ") and "--device" in err and len(err.strip().splitlines()) == 1, err
        assert not out.exists()
    code, _, err = run(*args, "--device", "cpu")
    assert code == 0, err
