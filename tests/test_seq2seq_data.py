"""Text data for encoder-decoders (issue 31): ``text:`` made causal-LM batches (input ids
alone), which T5 and BART refuse ("You must specify exactly one of input_ids or
inputs_embeds"). Each window is now a continuation: the encoder reads its first half,
the decoder predicts the second. The batches must score what the model's own loss does
(its ``labels`` path), a causal model must keep its batches, and `barrier` and
data-driven `match` must run on the folders."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import symspec
from symspec.data import load_data
from symspec.data.base import DataError
from tests.cli_files import WORDS, run, write_words
from tests.zoo import ZOO

transformers = pytest.importorskip("transformers")

VOCAB = len(set(" ".join(WORDS) + ".\n"))
FAMILIES = ["t5", "bart"]


def _text(tmp_path: Path) -> Path:
    text = tmp_path / "words.txt"
    write_words(text)
    return text


@pytest.mark.parametrize("name", FAMILIES)
def test_an_encoder_decoder_reads_windows_as_continuations(tmp_path: Path, name: str) -> None:
    model, _ = ZOO[name](vocab=VOCAB)
    data = load_data(f"text:{_text(tmp_path)},block=16", model=model, batch_size=4)
    inputs, targets = data.batches[0]
    assert set(inputs) == {"input_ids", "decoder_input_ids", "use_cache"} and inputs["use_cache"] is False
    assert inputs["input_ids"].shape == (4, 8) and targets.shape == (4, 8) == inputs["decoder_input_ids"].shape
    start = model.config.decoder_start_token_id
    assert torch.all(inputs["decoder_input_ids"][:, 0] == start)
    assert torch.equal(inputs["decoder_input_ids"][:, 1:], targets[:, :-1])  # shifted right
    assert data.details["encoder_tokens"] == 8 and data.details["decoder_tokens"] == 8
    with torch.no_grad():
        ours = data.loss(model(**inputs), targets)
        theirs = model(input_ids=inputs["input_ids"], labels=targets).loss  # the model's own shift and loss
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
    # the text continues across the halves: the decoder's targets follow the encoder's input
    x = torch.cat([inputs["input_ids"], targets], dim=1)
    assert torch.equal(x[0, 8:], targets[0])


def test_a_causal_model_keeps_its_next_token_windows(tmp_path: Path) -> None:
    model, _ = ZOO["llama"](vocab=VOCAB)
    data = load_data(f"text:{_text(tmp_path)},block=16", model=model, batch_size=4)
    (x,), y = data.batches[0]
    assert x.shape == y.shape == (4, 16) and torch.equal(x[:, 1:], y[:, :-1])


def test_an_encoder_decoder_without_a_start_token_is_one_line(tmp_path: Path) -> None:
    model, _ = ZOO["t5"](vocab=VOCAB)
    model.config.decoder_start_token_id = None
    with pytest.raises(DataError, match=r"encoder-decoder without config.decoder_start_token_id"):
        load_data(f"text:{_text(tmp_path)},block=16", model=model)
    model.config.decoder_start_token_id = 0
    with pytest.raises(DataError, match=r"windows of at least 2 tokens"):
        load_data(f"text:{_text(tmp_path)},block=1", model=model)


@pytest.mark.parametrize("name", FAMILIES)
def test_barrier_and_data_driven_match_run_on_encoder_decoder_folders(tmp_path: Path, name: str) -> None:
    """`barrier` between two independent models runs, vanilla and aligned, and scores A
    as the model's own loss does; weight+activation on a planted pair (B = g.A) finds g
    again to 1e-5."""
    from safetensors.torch import load_file

    from symspec.spec import load_spec
    from symspec.transforms import canonicalize_state_dict

    model, _ = ZOO[name](vocab=VOCAB)
    model.save_pretrained(tmp_path / "a")
    ZOO[name](seed=1, vocab=VOCAB)[0].save_pretrained(tmp_path / "c")
    text = _text(tmp_path)
    data = f"text:{text},block=16"
    code, out, err = run("barrier", tmp_path / "a", tmp_path / "c", "--data", data, "--points", 3,
                         "--align", "none", "--align", "weight", "--json")
    assert code == 0, err
    by = {m["method"]: m["summary"] for m in json.loads(out)["methods"]}
    assert set(by) == {"none", "weight"} and all(0 <= s["barrier_mean"] < 10 for s in by.values())
    val = load_data(data, model=model, split="val", batch_size=64)
    with torch.no_grad():
        own = [float(model(input_ids=x["input_ids"], labels=y).loss) * y.numel() for x, y in val.batches]
    loss_a = sum(own) / sum(y.numel() for _, y in val.batches)
    assert by["none"]["loss_a_mean"] == pytest.approx(loss_a, rel=1e-5)
    assert by["weight"]["loss_a_mean"] == pytest.approx(loss_a, rel=1e-4)
    spec = load_spec(name)
    planted = symspec.plant(model, spec, seed=2)
    planted.model.save_pretrained(tmp_path / "b")
    code, out, err = run("match", tmp_path / "a", tmp_path / "b", "--method", "weight+activation", "--data", data,
                         "--out", tmp_path / "out", "--json")
    assert code == 0, err
    bound = symspec.bind(spec, model)
    ca = canonicalize_state_dict(bound, {k: v.detach() for k, v in model.state_dict().items()})
    got = {k: v for shard in sorted((tmp_path / "out").glob("model*.safetensors")) for k, v in load_file(shard).items()}
    num = den = 0.0
    for k in bound.problem.params:
        if k in got:
            num += float((got[k].double() - ca[k].double()).square().sum())
            den += float(ca[k].double().square().sum())
    assert (num / den) ** 0.5 <= 1e-5, (num / den) ** 0.5
