"""Data adapters: character text, MNIST idx files, scikit-learn digits, and the model-file hook.

All data here are generated in the test (a small text, idx files written with
write_idx); the real files in ../shared/data are only read by the tests at the end,
which skip, saying so, when they are missing.
"""

from __future__ import annotations

import math
import random
import textwrap
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from symspec.data import (
    MNIST_MEAN,
    MNIST_STD,
    SPLITS,
    DataError,
    check_fits,
    load_data,
    parse_source,
    read_idx,
    split_bounds,
    write_idx,
)
from symspec.errors import SymspecInputError
from symspec.loading import load_model
from tests.needs import shared_data
from tests.zoo import example


def gpt(vocab: int, block: int = 8) -> torch.nn.Module:
    torch.manual_seed(0)
    return example("nanogpt").build(vocab_size=vocab, block_size=block, n_layer=1, n_head=2, n_embd=8, n_ff=12).eval()


def vit(image: int = 8, patch: int = 4, channels: int = 1, classes: int = 10) -> torch.nn.Module:
    torch.manual_seed(0)
    return example("vit").build(image_size=image, patch_size=patch, channels=channels, n_classes=classes, n_layer=1,
                                n_head=2, n_embd=8, mlp_ratio=2).eval()


def write_text(tmp_path: Path, n: int = 2000, alphabet: str = "abcdefgh \n", seed: int = 0, name: str = "t.txt") -> Path:
    rng = random.Random(seed)
    p = tmp_path / name
    p.write_text(alphabet + "".join(rng.choice(alphabet) for _ in range(n - len(alphabet))))
    return p


def write_mnist(folder: Path, n: int = 50, size: int = 8, prefix: str = "t10k", seed: int = 0,
                classes: int = 10) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    images = torch.randint(0, 256, (n, size, size), generator=g, dtype=torch.uint8)
    labels = torch.randint(0, classes, (n,), generator=g).to(torch.uint8)
    folder.mkdir(parents=True, exist_ok=True)
    write_idx(folder / f"{prefix}-images-idx3-ubyte.gz", images)
    write_idx(folder / f"{prefix}-labels-idx1-ubyte.gz", labels)
    return images, labels


def decode(ids: torch.Tensor, alphabet: list[str]) -> str:
    return "".join(alphabet[i] for i in ids.tolist())


# ----------------------------------------------------------------------------- parsing

def test_parse_source_kinds_paths_and_options(tmp_path: Path) -> None:
    txt = write_text(tmp_path)
    assert parse_source(f"text:{txt},context=4").options == {"context": "4"}
    assert parse_source(str(txt)).kind == "text"  # recognised by its suffix
    assert parse_source(str(tmp_path)).kind == "mnist"  # a folder
    assert parse_source("digits,size=4").options == {"size": "4"}
    assert parse_source("hook,seq=3").options == {"seq": "3"}


@pytest.mark.parametrize("text, msg", [
    ("", "empty --data"),
    ("txt:foo.txt", "unknown data kind 'txt'; did you mean 'text'?"),
    ("text:a.txt,contxt=3", "unknown option 'contxt' for text data; did you mean 'context'?"),
    ("text:a.txt,context", "not key=value"),
    ("text:", "needs a path"),
    ("digits:somewhere", "takes no path"),
    ("nowhere.bin", "no such file or folder"),
])
def test_bad_sources_are_named(text: str, msg: str) -> None:
    with pytest.raises(DataError, match=msg):
        parse_source(text)


def test_data_errors_are_input_errors() -> None:
    assert issubclass(DataError, SymspecInputError)


@given(st.integers(0, 5000), st.tuples(st.floats(0, 1), st.floats(0, 1), st.floats(0, 1)).filter(lambda t: sum(t) > 0))
def test_splits_are_contiguous_disjoint_and_cover_everything(n: int, raw: tuple[float, float, float]) -> None:
    total = sum(raw)
    fr = (raw[0] / total, raw[1] / total, raw[2] / total)
    bounds = [split_bounds(n, fr, s) for s in SPLITS]
    assert bounds[0][0] == 0 and bounds[-1][1] == n
    assert all(bounds[i][1] == bounds[i + 1][0] for i in range(2))
    assert all(lo <= hi for lo, hi in bounds)
    assert all(abs((hi - lo) - f * n) <= 1 for (lo, hi), f in zip(bounds, fr))


@pytest.mark.parametrize("split, msg", [("1/2", "three"), ("a/b/c", "three numbers"), ("0/0/0", "non-negative"),
                                        ("-1/1/1", "non-negative")])
def test_bad_split_fractions(tmp_path: Path, split: str, msg: str) -> None:
    txt = write_text(tmp_path)
    with pytest.raises(DataError, match=msg):
        load_data(f"text:{txt},split={split}", model=gpt(10))


# ----------------------------------------------------------------------------- text

def test_text_windows_are_the_file_shifted_by_one(tmp_path: Path) -> None:
    txt = write_text(tmp_path)
    content = txt.read_text()
    alphabet = sorted(set(content))
    model = gpt(len(alphabet), block=8)
    seen = []
    for split in SPLITS:
        data = load_data(f"text:{txt}", model=model, split=split, batch_size=5)
        assert data.details["vocab"] == len(alphabet) and data.details["context"] == 8  # from model.config.block_size
        x = torch.cat([b[0][0] for b in data.batches])
        y = torch.cat([b[1] for b in data.batches])
        assert x.shape[1] == 8 and torch.equal(x[:, 1:], y[:, :-1])
        start, stop = split_bounds(len(content), (0.8, 0.1, 0.1), split)
        flat = decode(x.reshape(-1), alphabet) + decode(y[-1, -1:], alphabet)
        assert flat == content[start : start + len(flat)]
        assert len(flat) > (stop - start) - 9  # every full window of the split is used
        seen.append((start, stop))
    assert seen[0][1] == seen[1][0] and seen[1][1] == seen[2][0]


def test_text_context_option_and_max_samples(tmp_path: Path) -> None:
    txt = write_text(tmp_path)
    model = gpt(10, block=8)
    data = load_data(f"text:{txt},context=4", model=model, max_samples=7, batch_size=3)
    assert data.examples == 7 and data.targets == 28 and [len(b[1]) for b in data.batches] == [3, 3, 1]
    with pytest.raises(DataError, match="context 9 is longer than the model's 8 positions"):
        load_data(f"text:{txt},context=9", model=model)


def test_text_vocabulary_must_fit_the_model(tmp_path: Path) -> None:
    txt = write_text(tmp_path)  # 10 characters
    load_data(f"text:{txt}", model=gpt(10))
    with pytest.raises(DataError, match="alphabet has 10 characters but the model's vocabulary has 8"):
        load_data(f"text:{txt}", model=gpt(8))
    with pytest.raises(DataError, match="alphabet has 10 characters but the model's vocabulary has 12"):
        load_data(f"text:{txt}", model=gpt(12))


def test_text_alphabet_from_another_file(tmp_path: Path) -> None:
    train = write_text(tmp_path, alphabet="abcdefgh \n", name="train.txt")
    other = write_text(tmp_path, alphabet="abc \n", name="other.txt", seed=1)
    data = load_data(f"text:{other},alphabet={train}", model=gpt(10))
    x = torch.cat([b[0][0] for b in data.batches])
    full = sorted(set(train.read_text()))
    assert set(decode(x.reshape(-1), full)) <= set("abc \n")
    with pytest.raises(DataError, match="5 characters but the model's vocabulary has 10"):
        load_data(f"text:{other}", model=gpt(10))  # its own alphabet would be wrong for the model
    with pytest.raises(DataError, match="not in the alphabet"):
        load_data(f"text:{train},alphabet={other}", model=gpt(5))


def test_empty_text_split_is_an_error(tmp_path: Path) -> None:
    txt = write_text(tmp_path, n=60)
    with pytest.raises(DataError, match="the val split holds 6 characters, fewer than one window"):
        load_data(f"text:{txt}", model=gpt(10), split="val")
    with pytest.raises(DataError, match="the test split holds 0 characters"):
        load_data(f"text:{txt},split=1/0/0", model=gpt(10), split="test")
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(DataError, match="empty"):
        load_data(f"text:{tmp_path / 'empty.txt'}", model=gpt(10))


def test_unreadable_text_files(tmp_path: Path) -> None:
    (tmp_path / "bin.txt").write_bytes(b"\xff\xfe\x00abc")
    with pytest.raises(DataError, match="not UTF-8"):
        load_data(f"text:{tmp_path / 'bin.txt'}", model=gpt(10))
    with pytest.raises(DataError, match="no such text file"):
        load_data(f"text:{tmp_path / 'missing.txt'}", model=gpt(10))
    # what exists but is no file is named as what it is (it once read "no such text file")
    with pytest.raises(DataError, match=r"dev/zero: is a character device, not a text file"):
        load_data("text:/dev/zero", model=gpt(10))
    (tmp_path / "folder.txt").mkdir()
    with pytest.raises(DataError, match="is a folder, not a text file"):
        load_data(f"text:{tmp_path / 'folder.txt'}", model=gpt(10))


def test_text_without_a_known_context_needs_the_option(tmp_path: Path) -> None:
    txt = write_text(tmp_path)

    class Bare(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = torch.nn.Embedding(10, 10)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.emb(x)

    with pytest.raises(DataError, match="context length is unknown"):
        load_data(f"text:{txt}", model=Bare())
    data = load_data(f"text:{txt},context=5", model=Bare())
    check_fits(Bare(), data)
    small = Bare()
    small.emb = torch.nn.Embedding(6, 10)  # no config: only running it shows that 10 characters do not fit
    with pytest.raises(DataError, match=r"does not fit the model: it fails on the first batch with IndexError.*vocabulary"):
        check_fits(small, data)


# ----------------------------------------------------------------------------- idx / MNIST

@given(st.lists(st.integers(1, 5), min_size=1, max_size=4), st.booleans(), st.integers(0, 100))
def test_idx_round_trip(shape: list[int], gz: bool, seed: int) -> None:
    import tempfile

    x = torch.randint(0, 256, shape, generator=torch.Generator().manual_seed(seed), dtype=torch.uint8)
    with tempfile.TemporaryDirectory() as d:
        p = write_idx(Path(d) / ("x.idx.gz" if gz else "x.idx"), x)
        assert torch.equal(read_idx(p), x)


def test_bad_idx_files_are_named(tmp_path: Path) -> None:
    (tmp_path / "short").write_bytes(b"\x00\x00")
    with pytest.raises(DataError, match="too short"):
        read_idx(tmp_path / "short")
    (tmp_path / "magic").write_bytes(b"\x01\x02\x03\x04" + bytes(8))
    with pytest.raises(DataError, match="not an unsigned-byte idx file"):
        read_idx(tmp_path / "magic")
    p = write_idx(tmp_path / "ok", torch.zeros(3, 4, dtype=torch.uint8))
    p.write_bytes(p.read_bytes()[:-1])
    with pytest.raises(DataError, match="header says"):
        read_idx(p)
    (tmp_path / "broken.gz").write_bytes(b"not gzip at all")
    with pytest.raises(DataError, match="cannot be read"):
        read_idx(tmp_path / "broken.gz")
    with pytest.raises(DataError, match="unsigned bytes"):
        write_idx(tmp_path / "f", torch.zeros(3))


def test_mnist_pixels_labels_and_normalisation(tmp_path: Path) -> None:
    images, labels = write_mnist(tmp_path / "m", n=50)
    data = load_data(f"mnist:{tmp_path / 'm'}", model=vit(8), split="train", batch_size=16)
    x = torch.cat([b[0][0] for b in data.batches])
    y = torch.cat([b[1] for b in data.batches])
    assert x.shape == (40, 1, 8, 8) and torch.equal(y, labels[:40].long())
    want = (images[:40].float() - MNIST_MEAN * 255) / (MNIST_STD * 255)
    assert torch.allclose(x[:, 0], want)
    test = load_data(f"mnist:{tmp_path / 'm'}", model=vit(8), split="test")
    assert torch.equal(torch.cat([b[1] for b in test.batches]), labels[45:].long())


def test_mnist_with_a_training_file_tests_on_t10k(tmp_path: Path) -> None:
    _, train_labels = write_mnist(tmp_path / "m", n=60, prefix="train", seed=1)
    _, test_labels = write_mnist(tmp_path / "m", n=20, prefix="t10k", seed=2)
    got = {s: torch.cat([b[1] for b in load_data(f"mnist:{tmp_path / 'm'}", model=vit(8), split=s).batches]) for s in SPLITS}
    assert torch.equal(got["test"], test_labels.long())
    # train and val share the training file in the ratio 0.8 : 0.1
    assert torch.equal(torch.cat([got["train"], got["val"]]), train_labels.long())
    assert len(got["train"]) == round(60 * 0.8 / 0.9)


def test_mnist_file_argument_finds_its_labels(tmp_path: Path) -> None:
    _, labels = write_mnist(tmp_path, n=30)
    data = load_data(f"mnist:{tmp_path / 't10k-images-idx3-ubyte.gz'},split=1/0/0", model=vit(8), split="train")
    assert torch.equal(torch.cat([b[1] for b in data.batches]), labels.long())
    (tmp_path / "t10k-labels-idx1-ubyte.gz").unlink()
    with pytest.raises(DataError, match="no labels file"):
        load_data(f"mnist:{tmp_path / 't10k-images-idx3-ubyte.gz'}", model=vit(8))
    with pytest.raises(DataError, match="no MNIST idx files"):
        load_data(f"mnist:{tmp_path}", model=vit(8))


def test_image_size_must_fit_the_model(tmp_path: Path) -> None:
    write_mnist(tmp_path / "m", size=12)
    with pytest.raises(DataError, match=r"images are 12x12 but the model takes 8x8; resize them with --data ...,size=8"):
        load_data(f"mnist:{tmp_path / 'm'}", model=vit(8))
    data = load_data(f"mnist:{tmp_path / 'm'},size=8", model=vit(8))
    assert data.batches[0][0][0].shape[-2:] == (8, 8)
    check_fits(vit(8), data)
    with pytest.raises(DataError, match="channel"):
        load_data(f"mnist:{tmp_path / 'm'},size=8,channels=3", model=vit(8))
    rgb = load_data(f"mnist:{tmp_path / 'm'},size=8", model=vit(8, channels=3))
    assert rgb.batches[0][0][0].shape[1] == 3
    check_fits(vit(8, channels=3), rgb)


def test_labels_must_fit_the_classes(tmp_path: Path) -> None:
    write_mnist(tmp_path / "m", classes=10, n=200)
    with pytest.raises(DataError, match="labels go up to 9 but the model has 5 classes"):
        load_data(f"mnist:{tmp_path / 'm'},split=1/0/0", model=vit(8, classes=5), split="train")


def test_empty_image_split(tmp_path: Path) -> None:
    write_mnist(tmp_path / "m", n=5)
    with pytest.raises(DataError, match="the val split is empty"):
        load_data(f"mnist:{tmp_path / 'm'}", model=vit(8), split="val")


def test_probe_explains_an_image_model_without_config(tmp_path: Path) -> None:
    write_mnist(tmp_path / "m", size=12)
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 10))
    data = load_data(f"mnist:{tmp_path / 'm'}", model=model)
    with pytest.raises(DataError, match=r"images are 1x12x12: does the model take that size"):
        check_fits(model, data)
    check_fits(model, load_data(f"mnist:{tmp_path / 'm'},size=8", model=model))


# ----------------------------------------------------------------------------- digits

def test_digits_are_8x8_and_cover_the_bundled_set() -> None:
    sizes = {}
    for s in SPLITS:
        data = load_data("digits", model=vit(8), split=s)
        assert data.batches[0][0][0].shape[1:] == (1, 8, 8)
        sizes[s] = data.examples
    assert sum(sizes.values()) == 1797
    pooled = torch.cat([b[0][0] for s in SPLITS for b in load_data("digits", split=s).batches])
    assert abs(float(pooled.mean())) < 1e-4 and abs(float(pooled.std()) - 1) < 1e-3
    with pytest.raises(DataError, match="images are 8x8 but the model takes 28x28"):
        load_data("digits", model=vit(28, 7))
    check_fits(vit(28, 7), load_data("digits,size=28", model=vit(28, 7)))


# ----------------------------------------------------------------------------- the hook

HOOK = textwrap.dedent('''
    import torch

    def build():
        torch.manual_seed(0)
        return torch.nn.Linear(3, 4)

    def example_inputs(model, batch=2, seed=0):
        return (torch.randn(batch, 3),)

    def data(split, batch_size=2, max_samples=None, seed=0, scale="1"):
        g = torch.Generator().manual_seed({"train": 0, "val": 1, "test": 2}[split] + seed)
        n = {"train": 10, "val": 5, "test": 0}[split]
        x = torch.randn(n, 3, generator=g) * float(scale)
        y = torch.randint(4, (n,), generator=g)
        return [(x[i:i + batch_size], y[i:i + batch_size]) for i in range(0, n, batch_size)]

    CALLS = []

    def loss(output, targets):
        CALLS.append(1)
        return torch.nn.functional.cross_entropy(output, targets)

    def accuracy(output, targets):
        return 0.25
''')


def hook_file(tmp_path: Path, text: str = HOOK, name: str = "hooked.py") -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


def test_hook_provides_data_loss_and_accuracy(tmp_path: Path) -> None:
    loaded = load_model(hook_file(tmp_path))
    mod = loaded.model_file.module  # type: ignore[union-attr]
    data = load_data(None, model=loaded.model, module=mod, split="val", batch_size=2)
    assert data.kind == "hook" and [len(b[1]) for b in data.batches] == [2, 2, 1]
    assert data.loss is mod.loss and data.accuracy is mod.accuracy
    scaled = load_data("hook,scale=3", model=loaded.model, module=mod, split="val", batch_size=5)
    assert torch.allclose(scaled.batches[0][0], torch.cat([b[0] for b in data.batches]) * 3)
    assert load_data("hook", model=loaded.model, module=mod, split="train", max_samples=3).examples == 3
    with pytest.raises(DataError, match="no option 'colour'"):
        load_data("hook,colour=red", model=loaded.model, module=mod)
    with pytest.raises(DataError, match="gave no batches: the test split is empty"):
        load_data(None, model=loaded.model, module=mod, split="test")


def test_model_file_loss_is_used_with_builtin_data_too(tmp_path: Path) -> None:
    loaded = load_model(hook_file(tmp_path))
    mod = loaded.model_file.module  # type: ignore[union-attr]
    data = load_data("digits", module=mod)
    assert data.loss is mod.loss
    assert load_data("digits").loss is not mod.loss


def test_missing_or_broken_hooks_are_named(tmp_path: Path) -> None:
    plain = load_model(hook_file(tmp_path, "import torch\ndef build():\n    return torch.nn.Linear(3, 4)\n", "plain.py"))
    with pytest.raises(DataError, match="no data: pass --data"):
        load_data(None, model=plain.model, module=plain.model_file.module)  # type: ignore[union-attr]
    with pytest.raises(DataError, match="defines no data"):
        load_data("hook", model=plain.model, module=plain.model_file.module)  # type: ignore[union-attr]
    for body, msg in [("def data(split):\n    return 3\n", "must return an iterable"),
                      ("def data(split):\n    return [(1, 2, 3)]\n", "must yield \\(inputs, targets\\) pairs"),
                      ("def data(split):\n    raise RuntimeError('disk on fire')\n", "failed: RuntimeError: disk on fire")]:
        bad = load_model(hook_file(tmp_path, "import torch\ndef build():\n    return torch.nn.Linear(3, 4)\n" + body,
                                   f"bad{abs(hash(body))}.py"))
        with pytest.raises(DataError, match=msg):
            load_data(None, model=bad.model, module=bad.model_file.module)  # type: ignore[union-attr]


def test_loss_that_is_not_a_scalar_is_refused(tmp_path: Path) -> None:
    loaded = load_model(hook_file(tmp_path))
    mod = loaded.model_file.module  # type: ignore[union-attr]
    data = load_data(None, model=loaded.model, module=mod, loss=lambda out, y: torch.nn.functional.cross_entropy(out, y, reduction="none"))
    with pytest.raises(DataError, match="scalar tensor"):
        check_fits(loaded.model, data)
    check_fits(loaded.model, load_data(None, model=loaded.model, module=mod))


def test_default_accuracy_applies_only_to_class_targets() -> None:
    from symspec.data import default_accuracy_if_classes as acc

    logits = torch.tensor([[2.0, 0.0], [0.0, 1.0], [3.0, 1.0]])
    assert float(acc(logits, torch.tensor([0, 1, 1]))) == pytest.approx(2 / 3)
    assert math.isnan(acc(logits, torch.randn(3)))  # regression targets: no accuracy
    assert math.isnan(acc(logits, torch.tensor([0, 1])))  # shapes that do not pair up


def test_bad_split_batch_and_sample_arguments(tmp_path: Path) -> None:
    txt = write_text(tmp_path)
    with pytest.raises(DataError, match="unknown split 'valid'; did you mean 'val'"):
        load_data(f"text:{txt}", model=gpt(10), split="valid")
    with pytest.raises(DataError, match="batch size"):
        load_data(f"text:{txt}", model=gpt(10), batch_size=0)
    with pytest.raises(DataError, match="max samples"):
        load_data(f"text:{txt}", model=gpt(10), max_samples=0)


# ----------------------------------------------------------------------------- the shared data

def test_tiny_shakespeare_fits_a_65_character_gpt() -> None:
    path = shared_data("tinyshakespeare.txt") / "tinyshakespeare.txt"
    data = load_data(f"text:{path}", model=gpt(65, block=64), split="val", max_samples=4)
    assert data.details["vocab"] == 65 and data.details["characters"] == pytest.approx(111539, abs=2)


def test_shared_mnist_is_28x28_with_ten_classes() -> None:
    folder = shared_data("mnist/t10k-images-idx3-ubyte.gz") / "mnist"
    sizes = [load_data(f"mnist:{folder}", model=vit(28, 7), split=s, batch_size=1000).examples for s in SPLITS]
    assert sizes == [8000, 1000, 1000]
    test = load_data(f"mnist:{folder}", model=vit(28, 7), split="test", batch_size=1000)
    assert test.details["classes"] == 10 and test.details["image_size"] == [28, 28]
