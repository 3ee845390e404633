"""What the command-line and analyzer tests share: a word text to train character models
on, a nanoGPT model file template, and a CLI runner."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

from click.testing import CliRunner

from symspec.cli.main import cli

ROOT = Path(__file__).resolve().parent.parent
WORDS = ["the", "cat", "sat", "on", "mat", "a", "dog", "ran"]

#: a model file for ``symspec`` commands: a one-layer nanoGPT of width ``d``
MODEL = '''
import torch
from symspec.loading import import_file

_ng = import_file({path!r})
SPEC = "nanogpt"


def build(**overrides):
    cfg = dict(vocab_size={vocab}, block_size=16, n_layer=1, n_head=2, n_embd={d}, n_ff=32)
    cfg.update(overrides)
    torch.manual_seed({seed})
    return _ng.build(**cfg)


example_inputs = _ng.example_inputs
loss = _ng.loss
'''


def run(*args: Any) -> tuple[int, str, str]:
    """``symspec ARGS...`` in-process: (exit code, stdout, stderr); an exception that is
    not an exit is raised."""
    result = CliRunner().invoke(cli, [str(a) for a in args])
    if result.exception and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result.exit_code, result.stdout, result.stderr


def write_words(path: Path) -> int:
    """1500 random words (seeded) into ``path``; returns the text's vocabulary size."""
    rng = random.Random(0)
    path.write_text(" ".join(rng.choice(WORDS) for _ in range(1500)) + ".\n")
    return len(set(path.read_text()))


def model_file(folder: Path, name: str, vocab: int, d: int = 16, seed: int = 0, extra: str = "") -> Path:
    """``MODEL`` written to ``folder/name`` (``extra`` appended)."""
    p = folder / name
    p.write_text(MODEL.format(path=str(ROOT / "examples" / "nanogpt.py"), vocab=vocab, d=d, seed=seed) + extra)
    return p


def gpt_checkpoints(folder: Path) -> dict[str, Path]:
    """Two state-dict checkpoints (seeds 0 and 1) of the model file ``gpt.py`` over a word
    text, in ``folder``: ``{"text", "model", "m0", "m1"}``."""
    import torch

    from symspec.loading import load_model

    text = folder / "words.txt"
    out = {"text": text, "model": model_file(folder, "gpt.py", write_words(text))}
    lm = load_model(out["model"]).model
    for i in range(2):
        torch.manual_seed(i)
        out[f"m{i}"] = folder / f"m{i}.pt"
        torch.save(type(lm)(lm.config).state_dict(), out[f"m{i}"])
    return out
