"""Data for real checkpoints: tokenised text, image folders, saved ``datasets``, and the
source registry.

Everything is built here: a word-level tokenizer trained on a paragraph (``tokenizers``)
saved as tokenizer.json beside a tiny GPT2LMHeadModel of its vocabulary, PNGs written
with Pillow, datasets saved with ``save_to_disk``. Nothing is downloaded.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from symspec.data import (
    SOURCES,
    DataError,
    DataRequest,
    EvalData,
    check_fits,
    cross_entropy,
    load_data,
    parse_source,
    register_source,
)
from symspec.loading import load_model
from tests.cli_files import ROOT, run
from tests.needs import optional

PARAGRAPH = ("the cat sat on the mat and the dog ran to the cat . a bird sang on the tree while the dog slept . "
             "the mat was red and the tree was tall . ")
CONTEXT = 16  # the tiny GPT-2's positions


def train_tokenizer(path: Path) -> Any:
    """A word-level tokenizer of PARAGRAPH, saved to ``path`` (tokenizer.json)."""
    tokenizers = optional("tokenizers")
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.train_from_iterator([PARAGRAPH], tokenizers.trainers.WordLevelTrainer(special_tokens=["[UNK]"]))
    tok.save(str(path))
    return tok


def save_gpt2(folder: Path, vocab: int, positions: int = CONTEXT, seed: int = 0) -> Path:
    transformers = optional("transformers")
    torch.manual_seed(seed)
    cfg = transformers.GPT2Config(vocab_size=vocab, n_positions=positions, n_embd=8, n_layer=1, n_head=2,
                                  bos_token_id=0, eos_token_id=0)
    transformers.GPT2LMHeadModel(cfg).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def lm(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A model folder (config, weights, tokenizer.json), a text, and the same model
    without its tokenizer."""
    root = tmp_path_factory.mktemp("lm")
    model = root / "gpt"
    model.mkdir()
    tok = train_tokenizer(model / "tokenizer.json")
    save_gpt2(model, tok.get_vocab_size())
    bare = root / "bare"
    shutil.copytree(model, bare)
    (bare / "tokenizer.json").unlink()
    text = root / "story.txt"
    text.write_text(PARAGRAPH * 30, encoding="utf-8")
    return {"root": root, "model": model, "bare": bare, "text": text, "tok": tok, "loaded": load_model(model)}


def error_line(err: str) -> str:
    """The one ``error:`` line of a failed command (progress bars may precede it)."""
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, err
    return lines[0]


def ids_of(tok: Any, text: str) -> torch.Tensor:
    return torch.tensor(tok.encode(text, add_special_tokens=False).ids)


# --------------------------------------------------------------------------- tokenised text

def test_tokenised_text_loss_is_next_token_cross_entropy(lm: dict[str, Any]) -> None:
    model = lm["loaded"].model.eval()
    data = load_data(f"text:{lm['text']}", model=model, split="val", batch_size=3, model_dir=lm["model"])
    text = lm["text"].read_text()
    val = text[round(len(text) * 0.8) : round(len(text) * 0.9)]
    ids = ids_of(lm["tok"], val)
    n = (len(ids) - 1) // CONTEXT
    assert data.details["tokenizer"] == str(lm["model"] / "tokenizer.json") and data.details["context"] == CONTEXT
    assert data.examples == n and data.details["tokens"] == len(ids) and data.details["max_id"] == int(ids.max())
    x = torch.cat([b[0][0] for b in data.batches])
    y = torch.cat([b[1] for b in data.batches])
    # the causal shift: inputs are ids[i*N : (i+1)*N], targets the same window one token on
    assert torch.equal(x, ids[: n * CONTEXT].view(n, CONTEXT))
    assert torch.equal(y, ids[1 : n * CONTEXT + 1].view(n, CONTEXT))
    with torch.no_grad():
        total = sum(float(data.loss(model(*inp), t)) * t.numel() for inp, t in data.batches) / data.targets
        logits = model(ids[: n * CONTEXT].view(n, CONTEXT)).logits
    direct = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[1 : n * CONTEXT + 1])
    assert total == pytest.approx(float(direct), rel=1e-5)
    assert float(direct) > 0.5  # an untrained model: far from a trivially zero loss
    check_fits(model, data)


def test_splits_are_cut_by_characters_then_tokenised(lm: dict[str, Any]) -> None:
    text = lm["text"].read_text()
    model = lm["loaded"].model
    seen = 0
    for split, (a, b) in {"train": (0, 0.5), "val": (0.5, 0.75), "test": (0.75, 1.0)}.items():
        data = load_data(f"text:{lm['text']},split=2/1/1,block=4", model=model, split=split)
        part = text[round(len(text) * a) : round(len(text) * b)]
        assert data.details["characters"] == len(part) and data.details["tokens"] == len(ids_of(lm["tok"], part))
        assert torch.equal(data.batches[0][0][0][0], ids_of(lm["tok"], part)[:4])
        seen += data.details["characters"]
    assert seen == len(text)


def test_max_samples_tokenises_a_prefix_with_the_same_windows(lm: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """--max-samples tokenises a prefix of the split, not all of it, and gives the same
    windows as the first ones of the whole split."""
    from symspec.data.tokenizer import TextTokenizer

    big = lm["root"] / "long.txt"
    big.write_text(PARAGRAPH * 400, encoding="utf-8")
    model = lm["loaded"].model
    whole = load_data(f"text:{big}", model=model, split="train", batch_size=4, model_dir=lm["model"])
    seen: list[int] = []
    encode = TextTokenizer.encode

    def recording(self: Any, text: str) -> torch.Tensor:
        seen.append(len(text))
        return encode(self, text)

    monkeypatch.setattr(TextTokenizer, "encode", recording)
    few = load_data(f"text:{big}", model=model, split="train", batch_size=4, model_dir=lm["model"], max_samples=6)
    assert few.examples == 6 and max(seen) < whole.details["characters"] / 4
    x_few = torch.cat([b[0][0] for b in few.batches])
    x_all = torch.cat([b[0][0] for b in whole.batches])[:6]
    assert torch.equal(x_few, x_all)


def test_block_option_and_default_block(lm: dict[str, Any]) -> None:
    model = lm["loaded"].model
    data = load_data(f"text:{lm['text']},block=5", model=model, split="train", max_samples=7, batch_size=4)
    assert [b[0][0].shape for b in data.batches] == [(4, 5), (3, 5)] and data.details["context"] == 5
    with pytest.raises(DataError, match="context 17 is longer than the model's 16 positions"):
        load_data(f"text:{lm['text']},block=17", model=model)
    with pytest.raises(DataError, match="block= and context= are the same option"):
        load_data(f"text:{lm['text']},block=4,context=4", model=model)
    # a long context: the default block is capped at 1024 tokens
    big = type("LM", (), {"config": {"vocab_size": 50, "max_position_embeddings": 4096}})()
    data = load_data(f"text:{lm['text']},split=1/0/0,tokenizer={lm['model']}", model=big, split="train")
    assert data.details["context"] == 1024 and data.batches[0][0][0].shape[1] == 1024
    with pytest.raises(DataError, match="context length is unknown"):
        load_data(f"text:{lm['text']},tokenizer={lm['model']}", model=None)


def test_the_model_folders_tokenizer_is_the_default(lm: dict[str, Any]) -> None:
    model = lm["loaded"].model
    explicit = load_data(f"text:{lm['text']}", model=model, model_dir=lm["model"])
    found = load_data(f"text:{lm['text']}", model=model)  # from the model's name_or_path
    given = load_data(f"text:{lm['text']},tokenizer={lm['model'] / 'tokenizer.json'}", model=load_model(lm["bare"]).model)
    for d in (found, given):
        assert d.details["tokenizer"] == explicit.details["tokenizer"]
        assert all(torch.equal(p[1], q[1]) for p, q in zip(d.batches, explicit.batches))
    code, out, err = run("barrier", lm["model"], lm["model"], "--data", f"text:{lm['text']}", "--points", 2, "--json")
    assert code == 0, err
    report = json.loads(out)
    assert report["data"]["tokenizer"] == str(lm["model"] / "tokenizer.json") and report["data"]["context"] == CONTEXT


def test_a_token_model_without_a_tokenizer_is_a_clear_error(lm: dict[str, Any]) -> None:
    code, _, err = run("barrier", lm["bare"], lm["bare"], "--data", f"text:{lm['text']}", "--points", 2)
    line = error_line(err)
    assert code == 2 and f"vocabulary has {lm['tok'].get_vocab_size()}" in line and f"tokenizer=DIR (none in {lm['bare']})" in line
    with pytest.raises(DataError, match="no tokenizer here"):
        load_data(f"text:{lm['text']},tokenizer={lm['root']}", model=lm["loaded"].model)
    with pytest.raises(DataError, match="no such tokenizer file or folder"):
        load_data(f"text:{lm['text']},tokenizer={lm['root'] / 'nothing'}")
    bad = lm["root"] / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(DataError, match=r"bad\.json: not a tokenizer file"):
        load_data(f"text:{lm['text']},tokenizer={bad}", model=lm["loaded"].model)
    with pytest.raises(DataError, match="alphabet= is for character text"):
        load_data(f"text:{lm['text']},alphabet={lm['text']}", model=lm["loaded"].model)


def test_a_character_model_folder_without_a_tokenizer_stays_character_level(lm: dict[str, Any]) -> None:
    chars = lm["root"] / "chars"
    save_gpt2(chars, len(set(PARAGRAPH)))
    data = load_data(f"text:{lm['text']}", model=load_model(chars).model, model_dir=chars)
    assert "tokenizer" not in data.details and data.details["vocab"] == len(set(PARAGRAPH))
    assert data.examples == (round(len(PARAGRAPH) * 30 * 0.1) - 1) // CONTEXT


def test_tokenizer_ids_must_fit_the_vocabulary(lm: dict[str, Any]) -> None:
    small = save_gpt2(lm["root"] / "small", 10)
    code, _, err = run("barrier", small, small, "--data", f"text:{lm['text']},tokenizer={lm['model']}", "--points", 2)
    top = lm["tok"].get_vocab_size() - 1  # the story uses every word of the tokenizer
    assert code == 2 and f"gives ids up to {top} but the model's vocabulary has 10" in error_line(err)


def test_a_text_shorter_than_one_block_is_refused(lm: dict[str, Any]) -> None:
    short = lm["root"] / "short.txt"
    short.write_text(PARAGRAPH * 2)  # the val split: about 9 tokens
    code, _, err = run("barrier", lm["model"], lm["model"], "--data", f"text:{short}", "--points", 2)
    assert code == 2 and "tokens, fewer than one window of 16 + 1" in error_line(err)
    assert load_data(f"text:{short},block=4", model=lm["loaded"].model).examples >= 1


def test_an_output_may_not_overwrite_the_tokenizer(lm: dict[str, Any]) -> None:
    assert parse_source("text:a.txt,tokenizer=t/,alphabet=b.txt").paths() == ["a.txt", "b.txt", "t/"]
    tok = lm["root"] / "tok" / "tokenizer.json"
    tok.parent.mkdir()
    shutil.copy(lm["model"] / "tokenizer.json", tok)
    code, _, err = run("barrier", lm["bare"], lm["bare"], "--data", f"text:{lm['text']},tokenizer={tok.parent}",
                       "--points", 2, "--report", tok, "--force")
    assert code == 2 and str(tok) in error_line(err) and json.loads(tok.read_text())["model"]["type"] == "WordLevel"


def test_autotokenizer_reads_a_folder_without_tokenizer_json(lm: dict[str, Any]) -> None:
    optional("transformers")
    folder = lm["root"] / "bert_vocab"
    folder.mkdir()
    words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", *sorted(set(PARAGRAPH.split()))]
    (folder / "vocab.txt").write_text("\n".join(words) + "\n")
    (folder / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "BertTokenizer"}))
    data = load_data(f"text:{lm['text']},tokenizer={folder},block=4,split=1/0/0", split="train")
    assert data.batches[0][0][0][0].tolist() == [words.index(w) for w in PARAGRAPH.split()[:4]]
    assert data.details["max_id"] < len(words) and data.details["tokenizer"] == str(folder)


# --------------------------------------------------------------------------- image folders

def write_png(path: Path, value: int | tuple[int, int, int], size: tuple[int, int] = (6, 6)) -> Path:
    from PIL import Image

    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("L" if isinstance(value, int) else "RGB", size, value).save(path)
    return path


def image_folder(root: Path, per_class: int = 10, classes: tuple[str, ...] = ("dog", "cat"), rgb: bool = False) -> Path:
    for c, name in enumerate(classes):
        for i in range(per_class):
            v = 20 * i + c
            write_png(root / name / f"{i:02d}.png", (v, v, v) if rgb else v)
    return root


def test_image_folders_classes_splits_and_normalisation(tmp_path: Path) -> None:
    root = image_folder(tmp_path / "imgs")
    (root / "notes.txt").write_text("not an image")
    (root / "cat" / "README").write_text("skipped")
    sizes = {}
    for split in ("train", "val", "test"):
        data = load_data(f"images:{root}", split=split, batch_size=64)
        x, y = data.batches[0][0][0], data.batches[0][1]
        sizes[split] = len(y)
        assert x.shape[1:] == (1, 6, 6) and data.kind == "images" and data.details["classes"] == 2
        assert y.tolist() == [0, 1] * (len(y) // 2)  # cat (sorted first) = 0, dog = 1; the classes in turn
    assert sizes == {"train": 16, "val": 2, "test": 2}
    train = load_data(f"images:{root}", split="train", max_samples=3)
    # cat/00.png has pixel value 1, dog/00.png 0: (v/255 - mean) / std with MNIST's defaults
    x = train.batches[0][0][0]
    assert torch.allclose(x[0], torch.full((1, 6, 6), (1 / 255 - 0.1307) / 0.3081))
    assert torch.allclose(x[1], torch.full((1, 6, 6), (0 - 0.1307) / 0.3081))
    assert train.examples == 3


def test_image_preprocessing_from_the_model(tmp_path: Path) -> None:
    root = image_folder(tmp_path / "imgs", rgb=True)
    vit = type("ViT", (), {"config": {"image_size": 8, "channels": 1, "n_classes": 10}})()
    data = load_data(f"images:{root}", model=vit)  # grey 8x8, as the config says
    assert data.batches[0][0][0].shape[1:] == (1, 8, 8)
    assert load_data(f"images:{root}").batches[0][0][0].shape[1:] == (3, 6, 6)  # RGB files, no model
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "preprocessor_config.json").write_text(json.dumps(
        {"image_mean": [0.5, 0.5, 0.5], "image_std": [0.25, 0.25, 0.25], "size": {"height": 4, "width": 4},
         "rescale_factor": 1 / 255}))
    data = load_data(f"images:{root}", model_dir=folder, split="test")
    x = data.batches[0][0][0]
    assert x.shape[1:] == (3, 4, 4) and data.details["preprocessing"]["from"].endswith("preprocessor_config.json")
    v = 20 * 9 + 1  # the test split's first image: cat/09.png
    assert torch.allclose(x[0], torch.full((3, 4, 4), (v / 255 - 0.5) / 0.25), atol=1e-6)
    few = type("ViT", (), {"config": {"image_size": 6, "num_channels": 3, "num_labels": 1}})()
    with pytest.raises(DataError, match="labels go up to 1 but the model has 1 classes"):
        load_data(f"images:{root}", model=few)
    (folder / "preprocessor_config.json").write_text(json.dumps({"image_mean": [0.5, 0.5], "image_std": [1, 1]}))
    with pytest.raises(DataError, match=r"preprocessor_config.json: image_mean \[0.5, 0.5\] does not fit 3"):
        load_data(f"images:{root}", model_dir=folder)


def test_image_folders_with_split_folders(tmp_path: Path) -> None:
    root = tmp_path / "imgs"
    image_folder(root / "train", per_class=3)
    image_folder(root / "test", per_class=2, classes=("dog", "emu"))
    test = load_data(f"images:{root}", split="test")
    assert test.batches[0][1].tolist() == [1, 2, 1, 2] and test.details["classes"] == 3  # cat, dog, emu
    assert load_data(f"images:{root}", split="train").examples == 6
    with pytest.raises(DataError, match="no folder for the val split; splits there are: test, train"):
        load_data(f"images:{root}", split="val")
    with pytest.raises(DataError, match="split= fractions do not apply"):
        load_data(f"images:{root},split=0.5/0.5/0", split="train")
    image_folder(root / "validation", per_class=1)
    assert load_data(f"images:{root}", split="val").examples == 2


def test_bad_image_folders_name_the_file(tmp_path: Path) -> None:
    root = image_folder(tmp_path / "imgs", per_class=2)
    (root / "dog" / "broken.png").write_bytes(b"\x89PNG not really")
    with pytest.raises(DataError, match=r"broken.png: not a readable image"):
        load_data(f"images:{root},split=1/0/0", split="train")
    (root / "dog" / "broken.png").unlink()
    write_png(root / "dog" / "wide.png", 3, size=(9, 6))
    with pytest.raises(DataError, match=r"wide.png: the image is 9x6 \(width x height\) but the first one is 6x6"):
        load_data(f"images:{root},split=1/0/0", split="train")
    assert load_data(f"images:{root},split=1/0/0,size=5", split="train").batches[0][0][0].shape[1:] == (1, 5, 5)
    with pytest.raises(DataError, match="not 2 channels"):
        load_data(f"images:{root},channels=2")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(DataError, match="no class folders"):
        load_data(f"images:{empty}")
    with pytest.raises(DataError, match="no such image folder"):
        load_data(f"images:{tmp_path / 'none'}")
    with pytest.raises(DataError, match="the val split holds no images"):
        load_data(f"images:{root},split=1/0/0", split="val")


def test_image_folder_errors_exit_2_in_the_cli(tmp_path: Path) -> None:
    root = image_folder(tmp_path / "imgs", per_class=2)
    vit = ROOT / "examples" / "vit.py"
    code, out, err = run("barrier", vit, vit, "--data", f"images:{root},split=1/0/0", "--split", "train",
                         "--points", 2, "--json")
    assert code == 0, err
    assert json.loads(out)["data"]["image_size"] == [28, 28]  # resized to the model's config
    (root / "cat" / "bad.png").write_bytes(b"junk")
    code, _, err = run("barrier", vit, vit, "--data", f"images:{root},split=1/0/0", "--split", "train", "--points", 2)
    assert code == 2 and "bad.png: not a readable image" in error_line(err)


# --------------------------------------------------------------------------- saved datasets (hf:)

@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    datasets = optional("datasets", "pip install 'symspec[datasets]'")
    root = tmp_path_factory.mktemp("datasets")
    lines = [s.strip() + " ." for s in PARAGRAPH.split(" . ") if s.strip()]
    rows = {"train": lines * 10, "validation": lines * 3, "test": lines * 2}
    datasets.DatasetDict({k: datasets.Dataset.from_dict({"text": v, "n": list(range(len(v)))})
                          for k, v in rows.items()}).save_to_disk(str(root / "text"))
    datasets.DatasetDict({k: datasets.Dataset.from_dict({"text": rows[k]}) for k in ("train", "test")}).save_to_disk(
        str(root / "two"))
    datasets.Dataset.from_dict({"text": lines * 20}).save_to_disk(str(root / "one"))
    from PIL import Image

    images = [Image.new("L", (5, 5), 10 * i) for i in range(8)]
    features = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=["a", "b", "c"])})
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"image": images, "label": [i % 3 for i in range(8)]},
                                                              features=features)}).save_to_disk(str(root / "images"))
    return {"root": root, **{k: root / k for k in ("text", "two", "one", "images")}, "rows": rows}  # type: ignore[dict-item]


def test_hf_text_columns_are_tokenised(saved: dict[str, Any], lm: dict[str, Any]) -> None:
    model = lm["loaded"].model
    data = load_data(f"hf:{saved['text']},block=4", model=model, split="val")
    ids = ids_of(lm["tok"], "\n".join(saved["rows"]["validation"]))
    assert data.details["dataset_split"] == "validation" and data.details["column"] == "text"
    assert torch.equal(torch.cat([b[0][0] for b in data.batches]).flatten(), ids[: data.examples * 4])
    assert data.details["tokens"] == len(ids)
    named = load_data(f"hf:{saved['two']},split=train/test/test,column=text,block=4", model=model, split="val")
    assert named.details["dataset_split"] == "test"
    one = load_data(f"hf:{saved['one']},split=0.5/0.25/0.25,block=4", model=model, split="test")
    assert one.details["dataset_split"] == "train" and one.details["fractions"] == [0.5, 0.25, 0.25]


def test_hf_unknown_splits_and_columns_list_what_is_there(saved: dict[str, Any], lm: dict[str, Any]) -> None:
    model = lm["loaded"].model
    with pytest.raises(DataError, match=r"no dataset split for the val split \(splits there are: train, test\)"):
        load_data(f"hf:{saved['two']}", model=model, split="val")
    with pytest.raises(DataError, match="unknown split 'dev' in split=train/dev/test; splits there are: train, test"):
        load_data(f"hf:{saved['two']},split=train/dev/test", model=model, split="val")
    with pytest.raises(DataError, match="unknown column 'txt'; columns: text, n"):
        load_data(f"hf:{saved['text']},column=txt", model=model)
    with pytest.raises(DataError, match=r"column 'n' holds .*, neither text nor images"):
        load_data(f"hf:{saved['text']},column=n", model=model)
    with pytest.raises(DataError, match="split fractions apply to a dataset with one split"):
        load_data(f"hf:{saved['two']},split=0.5/0.5/0", model=model)
    code, _, err = run("barrier", lm["model"], lm["model"], "--data", f"hf:{saved['two']}", "--points", 2)
    assert code == 2 and "splits there are: train, test" in error_line(err)
    with pytest.raises(DataError, match="not a dataset saved with save_to_disk"):
        load_data(f"hf:{saved['root']}")


def test_hf_image_columns(saved: dict[str, Any]) -> None:
    data = load_data(f"hf:{saved['images']},split=0.5/0.25/0.25", split="train", max_samples=3)
    x, y = data.batches[0][0][0], data.batches[0][1]
    assert x.shape == (3, 1, 5, 5) and y.tolist() == [0, 1, 2] and data.details["classes"] == 3
    assert torch.allclose(x[1], torch.full((1, 5, 5), (10 / 255 - 0.1307) / 0.3081))
    with pytest.raises(DataError, match="no label column 'y'"):
        load_data(f"hf:{saved['images']},split=0.5/0.25/0.25,label=y", split="train")


def test_hf_without_datasets_says_how_to_install(saved: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "datasets", None)  # import datasets now raises ImportError
    with pytest.raises(DataError, match=r"needs the datasets library \(pip install 'symspec\[datasets\]'\)"):
        load_data(f"hf:{saved['text']}")


# --------------------------------------------------------------------------- the registry

def test_a_new_source_is_one_function_and_one_registration(tmp_path: Path) -> None:
    def ones(req: DataRequest) -> EvalData:
        n = int(req.source.options.get("n", "2"))
        return EvalData(f"ones:{req.source.arg}", "hook", req.split, [((torch.ones(n, 3),), torch.zeros(n, dtype=torch.long))],
                        cross_entropy, None)

    try:
        register_source("ones", ones, options=("n",))
        data = load_data("ones:anything,n=4")
        assert data.examples == 4 and data.inputs().__next__()[0].shape == (4, 3)
        assert data.take(1).batches == data.batches
        with pytest.raises(DataError, match="take: at least 1 batch"):
            data.take(0)
        with pytest.raises(DataError, match="unknown option 'm' for ones data; options: n"):
            parse_source("ones:x,m=1")
        with pytest.raises(DataError, match="ones data needs a path"):
            parse_source("ones")
    finally:
        SOURCES.pop("ones", None)
    with pytest.raises(DataError, match="unknown data kind 'ones'"):
        parse_source("ones:x")
