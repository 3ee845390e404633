"""Sharded bfloat16 Hugging Face folders: read lazily (the index, the shards' headers),
matched, merged, checked and interpolated, and written back in the input's dtype and
shard layout (the same files and index mapping; a single file stays single), with the
same weights as the whole-model path. A missing shard or a corrupt index is one line."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

import symspec
from symspec.loading import load_model, save_model
from symspec.loading.shards import INDEX, SINGLE, LazyStateDict, read_layout
from symspec.statedict import mapped_from_file, release_file_pages
from tests.cli_files import WORDS, run, write_words
from tests.zoo import ZOO

transformers = pytest.importorskip("transformers")

#: the alphabet of write_words' text: a character model reads it with its own vocabulary
VOCAB = len(set(" ".join(WORDS) + ".\n"))


def _folder(root: Path, seed: int, shard: str | None = "2KB", family: str = "qwen2") -> Path:
    """A tiny two-layer model saved in bfloat16, in several shards (``shard``: the most
    bytes per shard; None: one file)."""
    out = root / f"{family}-{seed}-{shard}"
    if not out.exists():
        model = ZOO[family](seed=seed, n_layer=2, vocab=VOCAB)[0].to(torch.bfloat16)
        model.save_pretrained(out, **({"max_shard_size": shard} if shard else {}))
    return out


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("sharded")
    return _folder(root, 0), _folder(root, 1)


def _files(folder: Path) -> list[str]:
    """The model's weight files (not the transform record)."""
    return sorted(p.name for p in folder.glob("model*.safetensors"))


def _weight_map(folder: Path) -> dict[str, str]:
    return json.loads((folder / INDEX).read_text())["weight_map"]


def _dtypes(folder: Path) -> set[str]:
    out = set()
    for f in folder.glob("model*.safetensors"):
        with safe_open(str(f), "pt") as h:
            out |= {h.get_slice(k).get_dtype() for k in h.keys()}  # noqa: SIM118
    return out


def test_the_fixture_is_sharded_bfloat16(pair: tuple[Path, Path]) -> None:
    a, _ = pair
    assert len(_files(a)) >= 3 and (a / INDEX).exists()
    assert _dtypes(a) == {"BF16"}


def test_layout_reads_the_index_and_tensors_lazily_in_their_own_dtype(pair: tuple[Path, Path]) -> None:
    a, _ = pair
    layout = read_layout(a)
    assert layout is not None and layout.files == _weight_map(a)
    assert set(layout.dtypes.values()) == {torch.bfloat16}
    lazy = LazyStateDict(layout)
    whole = load_model(a).model.state_dict()
    for k in lazy:  # the same tensors as loading the whole model
        assert lazy[k].dtype == torch.bfloat16 and torch.equal(lazy[k], whole[k]), k
    assert read_layout(a.parent) is None  # no safetensors: not a layout


def test_match_writes_the_input_layout_and_dtype_with_the_whole_model_weights(pair: tuple[Path, Path], tmp_path: Path) -> None:
    a, b = pair
    out = tmp_path / "out"
    code, _, err = run("match", a, b, "--out", out, "--rounds", 1, "--json")
    assert code == 0, err
    assert _files(out) == _files(b) and _weight_map(out) == _weight_map(b)
    assert _dtypes(out) == {"BF16"}
    # the same aligned weights as align() on the whole models, cast to bfloat16
    la, lb = load_model(a), load_model(b)
    res = symspec.align(la.model, lb.model, "qwen2", rounds=1, keep_canonical_b=False)
    lazy = LazyStateDict(read_layout(out))
    for k in lazy:
        assert torch.equal(lazy[k], res.aligned_b[k].to(torch.bfloat16)), k
    # and what the whole-model writer (save_pretrained) makes of them: the same tensors
    ref = tmp_path / "ref"
    m = load_model(b).model
    m.load_state_dict(res.aligned_b, strict=False)
    m.save_pretrained(ref)
    back = transformers.AutoModelForCausalLM.from_pretrained(out).state_dict()
    want = transformers.AutoModelForCausalLM.from_pretrained(ref).state_dict()
    assert back.keys() == want.keys() and all(torch.equal(back[k], want[k]) for k in want)


def test_merge_writes_a_s_layout(pair: tuple[Path, Path], tmp_path: Path) -> None:
    a, b = pair
    for extra in ([], ["--no-align"]):
        out = tmp_path / f"merged{len(extra)}"
        code, _, err = run("merge", a, b, "--out", out, "--rounds", 1, *extra)
        assert code == 0, err
        assert _files(out) == _files(a) and _weight_map(out) == _weight_map(a) and _dtypes(out) == {"BF16"}
        assert transformers.AutoModelForCausalLM.from_pretrained(out) is not None


def test_check_and_barrier_run_on_sharded_bfloat16_folders(pair: tuple[Path, Path], tmp_path: Path) -> None:
    a, b = pair
    code, _, err = run("check", a, "--samples", 1)
    assert code == 0, err
    text = tmp_path / "words.txt"
    write_words(text)
    code, out, err = run("barrier", a, b, "--data", f"text:{text},context=8", "--align", "weight", "--points", 3,
                         "--max-samples", 8, "--json")
    assert code == 0, err
    assert json.loads(out)["methods"][0]["method"] == "weight"


def test_a_single_file_stays_single(tmp_path: Path) -> None:
    a, b = _folder(tmp_path, 0, None), _folder(tmp_path, 1, None)
    out = tmp_path / "out"
    code, _, err = run("match", a, b, "--out", out, "--rounds", 1)
    assert code == 0, err
    assert _files(out) == [SINGLE] and not (out / INDEX).exists() and _dtypes(out) == {"BF16"}


def test_a_twin_stored_apart_is_written_beside_its_twin_and_untied(tmp_path: Path) -> None:
    folder = _folder(tmp_path, 0, "2KB", "llama_tied")
    loaded = load_model(folder)
    sd = {k: v.detach().clone() for k, v in loaded.model.state_dict().items()}
    assert "lm_head.weight" not in _weight_map(folder)  # tied: stored once
    out = tmp_path / "still-tied"
    save_model(loaded, sd, out)
    assert _weight_map(out) == _weight_map(folder)
    sd["lm_head.weight"] = sd["lm_head.weight"] * 2  # values of its own now
    out = tmp_path / "untied"
    save_model(loaded, sd, out)
    wm = _weight_map(out)
    assert wm["lm_head.weight"] == wm["model.embed_tokens.weight"]
    back = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert not back.config.tie_word_embeddings
    assert torch.equal(back.lm_head.weight, sd["lm_head.weight"].to(torch.bfloat16))


def _broken(pair: tuple[Path, Path], tmp_path: Path, how: str) -> Path:
    import shutil

    b = tmp_path / f"broken-{how}"
    shutil.copytree(pair[1], b)
    if how == "missing-shard":
        (b / sorted(set(_weight_map(b).values()))[1]).unlink()
    elif how == "corrupt-index":
        (b / INDEX).write_text("{not json")
    elif how == "index-without-map":
        (b / INDEX).write_text(json.dumps({"metadata": {}}))
    elif how == "tensor-not-in-shard":
        wm = _weight_map(b)
        name = next(iter(wm))
        wm[name] = next(f for f in set(wm.values()) if f != wm[name])
        (b / INDEX).write_text(json.dumps({"weight_map": wm}))
    return b


@pytest.mark.parametrize("how,words", [("missing-shard", "is missing"), ("corrupt-index", "unreadable index"),
                                       ("index-without-map", "weight_map"), ("tensor-not-in-shard", "does not hold it")])
@pytest.mark.parametrize("command", ["match", "check"])
def test_a_broken_sharded_folder_is_one_error_line(pair: tuple[Path, Path], tmp_path: Path, how: str, words: str,
                                                   command: str) -> None:
    a, _ = pair
    b = _broken(pair, tmp_path, how)
    before = sorted((p.name, p.stat().st_size) for p in b.iterdir())
    out = tmp_path / "out"
    args: list[Any] = ["match", a, b, "--out", out, "--rounds", 1] if command == "match" else ["check", b, "--samples", 1]
    code, _, err = run(*args)
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and words in lines[0] and str(b) in lines[0], err
    assert "Traceback" not in err and not out.exists()
    assert not list(tmp_path.glob(".symspec-staging-*"))
    assert sorted((p.name, p.stat().st_size) for p in b.iterdir()) == before  # inputs unchanged
    # positive control: the intact folder runs
    code, _, err = run(*[pair[1] if x == b else (tmp_path / "ok" if x == out else x) for x in args])
    assert code == 0, err


def test_release_file_pages_keeps_values_and_leaves_own_memory_alone(tmp_path: Path) -> None:
    want = torch.arange(4096 * 4, dtype=torch.float32)
    owned = want.clone()  # memory of its own: nothing to give back
    assert release_file_pages([owned]) == 0 and torch.equal(owned, want)
    path = tmp_path / "w.safetensors"
    save_file({"w": want}, str(path))
    with safe_open(str(path), "pt") as f:
        mapped = f.get_tensor("w")  # safetensors maps the file
    assert mapped_from_file([mapped, owned]) == {id(mapped)}
    assert release_file_pages([mapped]) > 0
    assert torch.equal(mapped, want)  # read again from the file
    model = ZOO["qwen2"](seed=0, n_layer=1, vocab=VOCAB)[0]
    model.save_pretrained(tmp_path / "m")
    loaded = load_model(tmp_path / "m").model
    before = {k: v.clone() for k, v in loaded.state_dict().items()}
    release_file_pages(loaded.state_dict().values())
    assert all(torch.equal(v, before[k]) for k, v in loaded.state_dict().items())


def test_align_leaves_the_callers_bfloat16_module_unchanged(pair: tuple[Path, Path]) -> None:
    a, b = pair
    la, lb = load_model(a).model, load_model(b).model
    before = {k: v.clone() for k, v in lb.state_dict().items()}
    res = symspec.align(la, lb, "qwen2", rounds=1, keep_canonical_b=False)
    after = lb.state_dict()
    assert all(after[k].dtype == torch.bfloat16 and torch.equal(after[k], v) for k, v in before.items())
    assert {v.dtype for v in res.aligned_b.values() if v.is_floating_point()} == {torch.bfloat16}


def test_squared_distance_in_pieces_equals_the_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    import symspec.statedict as sd

    g = torch.Generator().manual_seed(0)
    a = {"w": torch.randn(5, 9, generator=g), "v": torch.randn(3, generator=g, dtype=torch.float64).to(torch.bfloat16)}
    b = {"w": torch.randn(5, 9, generator=g), "v": torch.randn(3, generator=g).to(torch.bfloat16)}
    zero = dict.fromkeys(a, torch.zeros((), dtype=torch.float64))
    whole = sum(float((a[k].double() - b[k].double()).square().sum()) for k in a)
    norm = sum(float(a[k].double().square().sum()) for k in a)
    monkeypatch.setattr(sd, "DISTANCE_CHUNK", 7)  # pieces smaller than an entry
    assert sd.squared_distance(a, b, a) == pytest.approx(whole, rel=1e-14)
    assert sd.squared_distance(a, zero, a) == pytest.approx(norm, rel=1e-14)  # a scalar zero, broadcast
    assert sd.squared_distance(a, b, a) != pytest.approx(whole + 1e-6, rel=1e-14)  # the oracle can fail
